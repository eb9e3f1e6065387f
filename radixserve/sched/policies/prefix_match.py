"""What the cache-aware policies (``lpm``, ``dfs-weight``) need from the radix tree, made cheap.

``PrefixLengthCache``: the cached-prefix length of every waiting request, kept up to date
incrementally. SGLang re-matches every waiting request against the tree at every step, which is
why it falls back to FCFS past 128 waiting requests. Here each request's sort key is kept with the
request (its ``LPMState``, the ``Req.policy_state`` slot the policy owns) and is recomputed only when
the tree changed where its match stopped:

- the read-only match (``RadixCache.peek_prefix``) stops at node N, before the child slot K of
  the request's next token; the request registers a watcher there (``RadixCache.watch``);
- the tree calls the watcher when a child is added at K, the child at K is split or evicted, N
  itself is evicted, or the tree is reset: only then can the match length change (a split
  elsewhere on the path changes no length). The watcher clears the key;
- the next ordering re-matches only the requests whose key is cleared, from N (or N's nearest
  live ancestor when N went), not from the root.

So ordering N waiting requests costs a few C-level passes over the queue (``attrgetter`` over
the keys, the in-batch check, one sort of ints) plus a walk for each request whose match may
have changed, instead of a Python loop over all of them. The request being admitted is matched
for real (``KVManager.match``) as before.

``in_batch_deprioritized``: SGLang's in-batch prefix caching check. ``dfs_weight_order``: SGLang's
``_sort_by_dfs_weight`` (the tree walk is ``radix_walks.weighted_dfs``).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from itertools import compress
from operator import attrgetter
from typing import Any

from radixserve.mem.radix_cache import RadixCache
from radixserve.mem.radix_walks import live_ancestor, weighted_dfs
from radixserve.mem.tree_node import END, TreeNode
from radixserve.sched.req import Req

LPM_STALE = 1 << 200  # the key of a request lpm must match (again); above every real key
_SHIFT = 64  # sort key = -length * 2**64 + arrival in microseconds (clamped to [0, 2**64))
_BACK = 1 << 100  # added to the key of a request pushed to the back: after every other one
_get_key = attrgetter("policy_state.key")
_get_group = attrgetter("policy_state.group")
_get_state = attrgetter("policy_state")


class LPMState:
    """What lpm keeps on a waiting request (``Req.policy_state``): its sort key, its in-batch
    check group, its place in the kept order (``lpm_order.py``) and where its match stopped."""

    __slots__ = ("key", "group", "order", "match")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.key = LPM_STALE
        self.group: Any = None
        self.order: Any = None
        self.match: _Match | None = None


def ensure_states(reqs: Sequence[Req]) -> None:
    """Give each request that has none an ``LPMState`` (C-level scans; Python for the newcomers)."""
    states = list(map(_get_state, reqs))
    i = -1
    while True:
        try:
            i = states.index(None, i + 1)
        except ValueError:
            return
        reqs[i].policy_state = LPMState()


class _Match:
    """Where a waiting request's match stopped (``LPMState.match``); the watcher token."""

    __slots__ = ("req", "root", "node", "pos", "length", "key", "sink")

    def __init__(self, req: Req, root: TreeNode, node: TreeNode, pos: int, length: int, key: int,
                 sink: list[Req]) -> None:
        self.req, self.root, self.node, self.pos, self.length, self.key = req, root, node, pos, length, key
        self.sink = sink

    def invalidate(self) -> None:
        req = self.req
        if req.policy_state.match is self:  # else the request was re-matched, reset or admitted since
            req.policy_state.key = LPM_STALE
            self.sink.append(req)


class PrefixLengthCache:
    """Incremental cached-prefix lengths of waiting requests against one ``RadixCache``.

    ``sort_keys`` gives one int per request, ``-length * 2**64 + arrival_us``: ascending order is
    longest match first, then arrival, and sorting ints is cheap. A request's key is dropped when
    it is retracted or preempted (``Req.reset_for_retract``): its outputs became prompt."""

    def __init__(self) -> None:
        self._root: Any = None
        self._group_t = 0  # the in-batch check threshold the requests' groups were made for
        self.dirty: list[Req] = []  # requests whose key a watcher cleared (for lpm_order)
        self.num_matched = 0  # read-only matches run so far (a counter for benchmarks)

    def sort_keys(self, reqs: Sequence[Req], tree: RadixCache, group_t: int | None = None) -> list[int]:
        """The keys; with ``group_t``, each request's group for that threshold is set too."""
        try:
            keys = list(map(_get_key, reqs))
        except AttributeError:  # some have no LPMState yet
            ensure_states(reqs)
            keys = list(map(_get_key, reqs))
        if tree.root is not self._root or (group_t is not None and group_t != self._group_t):
            self._root = tree.root  # another tree (a reset one fires its watchers itself)
            self._group_t = self._group_t if group_t is None else group_t
            for r in reqs:
                r.policy_state.key = LPM_STALE
            keys = [LPM_STALE] * len(reqs)
        self.dirty.clear()  # every cleared key among reqs is recomputed here
        if LPM_STALE in keys:  # int compares: fast
            i = keys.index(LPM_STALE)
            while True:
                keys[i] = self._refresh(reqs[i], tree)
                try:
                    i = keys.index(LPM_STALE, i + 1)
                except ValueError:
                    break
        return keys

    def prefix_lens(self, reqs: Sequence[Req], tree: RadixCache) -> list[int]:
        return [-(k >> _SHIFT) for k in self.sort_keys(reqs, tree)]

    def refresh(self, req: Req, tree: RadixCache) -> int:
        """``req``'s key (and group), matched again if it was cleared."""
        if req.policy_state is None:
            req.policy_state = LPMState()
        k = req.policy_state.key
        return self._refresh(req, tree) if k == LPM_STALE else k

    def _refresh(self, req: Req, tree: RadixCache) -> int:
        self.num_matched += 1
        node: TreeNode | None = None
        pos = 0
        c = req.policy_state.match
        if c is not None and c.root is tree.root:
            node, pos = live_ancestor(c.node, c.pos)  # (evicted since: back to a live node)
        ids = req.origin_input_ids if not req.output_ids else req.fill_ids
        limit = len(ids) - 1
        node, pos, length = tree.peek_prefix(ids, req.extra_key, node, pos, limit=limit)
        arrival_us = min(max(int(req.arrival_time * 1e6), 0), (1 << _SHIFT) - 1)
        key = -length * (1 << _SHIFT) + arrival_us
        m = req.policy_state.match = _Match(req, tree.root, node, pos, length, key, self.dirty)
        req.policy_state.key = key
        if self._group_t > 0:
            req.policy_state.group = _group(req, self._group_t)
        ps = tree.page_size
        end = limit - limit % ps
        tree.watch(node, END if pos >= end else tree.child_key(node, ids[pos : pos + ps], req.extra_key), m)
        return key


def _group(req: Req, t: int) -> Any:
    if req.num_tokens - 1 < t:
        return id(req)  # too short to ever share T tokens: a group of its own (an int: no bytes equal it)
    ids = req.origin_input_ids if len(req.origin_input_ids) >= t else req.fill_ids
    b = array("q", ids[:t]).tobytes()  # bytes cache their hash; a tuple of ints does not
    return b if req.extra_key is None else (req.extra_key, b)


def lpm_sort_keys(reqs: Sequence[Req], tree: RadixCache, cache: PrefixLengthCache, check_threshold: int,
                  deprioritize_threshold: int) -> list[int]:
    """lpm's sort key of each request (ascending): longest cached prefix first, then arrival;
    the requests in-batch prefix caching pushes back after all others (``in_batch_deprioritized``:
    a candidate, in queue order, whose group was already seen)."""
    keys = cache.sort_keys(reqs, tree, deprioritize_threshold if deprioritize_threshold > 0 else None)
    if deprioritize_threshold > 0:
        floor = -check_threshold * (1 << _SHIFT)  # key >= floor <=> cached prefix <= check_threshold
        sel = list(map(floor.__le__, keys))
        groups = list(map(_get_group, compress(reqs, sel)))  # only the candidates' (attribute reads are slow)
        if len(set(groups)) < len(groups):  # some candidate shares its group with an earlier one
            seen: set[Any] = set()
            for i, g in zip(compress(range(len(keys)), sel), groups, strict=False):
                if g in seen:
                    keys[i] += _BACK
                else:
                    seen.add(g)
    return keys


def in_batch_deprioritized(
    reqs: Sequence[Req], prefix_lens: Sequence[int], check_threshold: int, deprioritize_threshold: int
) -> set[int]:
    """Indices of the requests to push to the back this round (SGLang's in-batch prefix caching).

    Walking the queue in order, a request whose cached prefix is at most ``check_threshold`` long is
    matched against the prompts of the requests before it that were not pushed back (SGLang's
    throwaway ``waiting_queue_radix_tree``). Sharing at least ``deprioritize_threshold`` tokens with
    one of them, it waits: once that one's prefill has run, the shared part is a cache hit.

    NOTE: only "does the in-batch match reach ``deprioritize_threshold`` tokens" matters, and a
    match reaches T tokens exactly when the first T tokens equal those of an earlier prompt, so the
    throwaway tree is a set of T-token prefixes here: same answers, O(T) per request.
    ``deprioritize_threshold`` 0 disables the check (in SGLang it would push back everything).
    """
    if deprioritize_threshold <= 0:
        return set()
    return _deprioritized(reqs, [i for i, n in enumerate(prefix_lens) if n <= check_threshold], deprioritize_threshold)


def _deprioritized(reqs: Sequence[Req], candidates: list[int], t: int) -> set[int]:
    """The candidates (queue order) sharing their first ``t`` tokens with an earlier kept one."""
    out: set[int] = set()
    seen: set[tuple[str | None, tuple[int, ...]]] = set()
    for i in candidates:
        req = reqs[i]
        if req.num_tokens - 1 < t:
            continue  # too short to ever share T tokens
        ids = req.origin_input_ids if len(req.origin_input_ids) >= t else req.fill_ids
        key = (req.extra_key, tuple(ids[:t]))
        if key in seen:
            out.add(i)
        else:
            seen.add(key)
    return out


def dfs_weight_order(reqs: Sequence[Req], tree: RadixCache) -> list[Req]:
    """SGLang's ``dfs-weight``: match every waiting request (its ``last_node``), weigh every tree
    node by the waiting requests whose match ends in its subtree, then walk the tree depth first,
    heavier children first (ties: the tree's child order), emitting a node's own requests after its
    subtree's. Requests sharing a hot branch come out together, the hottest branch first."""
    at: dict[Any, list[Req]] = {}
    for req in reqs:
        req.set_match(tree.match_prefix(req.match_key()))  # may split: last_node ends the match exactly
        at.setdefault(req.last_node, []).append(req)
    return weighted_dfs(tree.root, at)
