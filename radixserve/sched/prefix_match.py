"""What the cache-aware policies (``lpm``, ``dfs-weight``) need from the radix tree, made cheap.

``PrefixLengthCache``: the cached-prefix length of every waiting request, kept up to date
incrementally. SGLang re-matches every waiting request against the tree at every step, which is
why it falls back to FCFS past 128 waiting requests. Here each request remembers where its match
stopped: ``(node, node.gen, path length, match length)``. A node's ``gen`` changes only when a
child is added under it or removed from it, and becomes -1 when the node itself is evicted, so:

- ``gen`` unchanged: nothing that could lengthen or shorten this match happened; the length stands
  (a split of a node on the path changes no match length, and bumps nothing).
- ``gen`` changed: look again from that node (its path is still cached), not from the root.
- the node was evicted: climb to its nearest live ancestor and look again from there.

So ordering N waiting requests costs O(N) attribute reads plus the sort, and only requests whose
match could have changed walk the tree. The walk itself (``RadixCache.peek_prefix``) is read-only:
no node split, no access-time update, no lock; the request being admitted is matched for real
(``Req.init_next_round_input``) as before.

``in_batch_deprioritized``: SGLang's in-batch prefix caching check. ``dfs_weight_order``: SGLang's
``_sort_by_dfs_weight`` (seed 000, section 4.2.2.1).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from radixserve.mem.base_cache import BasePrefixCache
from radixserve.mem.radix_cache import RadixCache, TreeNode
from radixserve.sched.req import Req

_SHIFT = 64  # sort key = -length * 2**64 + arrival in microseconds (clamped to [0, 2**64))
_BACK = 1 << 100  # added to the key of a request pushed to the back: after every other one


class _Match:
    """Where a waiting request's match stopped, and its sort key (``Req.prefix_match_cache``)."""

    __slots__ = ("epoch", "node", "gen", "pos", "length", "key")

    def __init__(self, epoch: int, node: TreeNode, pos: int, length: int, arrival_us: int) -> None:
        self.epoch, self.node, self.gen, self.pos, self.length = epoch, node, node.gen, pos, length
        self.key = -length * (1 << _SHIFT) + arrival_us


class PrefixLengthCache:
    """Incremental cached-prefix lengths of waiting requests against one ``RadixCache``.

    ``sort_keys`` gives one int per request, ``-length * 2**64 + arrival_us``: ascending order is
    longest match first, then arrival, and sorting ints is cheap. A request's entry is dropped when
    it is retracted or preempted (``Req.reset_for_retract``): its outputs became prompt."""

    def __init__(self) -> None:
        self._root: Any = None
        self._epoch = 0  # bumped when the tree is reset (a new root): every entry is stale

    def sort_keys(self, reqs: Sequence[Req], tree: RadixCache) -> list[int]:
        if tree.root is not self._root:
            self._root = tree.root
            self._epoch += 1
        epoch = self._epoch
        out: list[int] = []
        append = out.append
        for req in reqs:  # the hot loop: three attribute reads per request when nothing changed
            c = req.prefix_match_cache
            if c is not None and c.gen == c.node.gen and c.epoch == epoch:
                append(c.key)
                continue
            append(self._refresh(req, tree, c if c is not None and c.epoch == epoch else None).key)
        return out

    def prefix_lens(self, reqs: Sequence[Req], tree: RadixCache) -> list[int]:
        return [-(k >> _SHIFT) for k in self.sort_keys(reqs, tree)]

    def _refresh(self, req: Req, tree: RadixCache, c: _Match | None) -> _Match:
        node: TreeNode | None = None
        pos = 0
        if c is not None:
            node, pos = c.node, c.pos
            while node.gen < 0:  # evicted: back to the nearest live ancestor
                pos -= len(node.key)
                node = node.parent
                assert node is not None
        ids = req.origin_input_ids if not req.output_ids else req.fill_ids
        node, pos, length = tree.peek_prefix(ids, req.extra_key, node, pos, limit=len(ids) - 1)
        arrival_us = min(max(int(req.arrival_time * 1e6), 0), (1 << _SHIFT) - 1)
        m = req.prefix_match_cache = _Match(self._epoch, node, pos, length, arrival_us)
        return m


def lpm_sort_keys(reqs: Sequence[Req], tree: RadixCache, cache: PrefixLengthCache, check_threshold: int,
                  deprioritize_threshold: int) -> list[int]:
    """lpm's sort key of each request (ascending): longest cached prefix first, then arrival;
    the requests in-batch prefix caching pushes back after all others."""
    keys = cache.sort_keys(reqs, tree)
    if deprioritize_threshold > 0:
        floor = -check_threshold * (1 << _SHIFT)  # key >= floor <=> cached prefix <= check_threshold
        cand = [i for i, k in enumerate(keys) if k >= floor]
        for i in _deprioritized(reqs, cand, deprioritize_threshold):
            keys[i] += _BACK
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


def dfs_weight_order(reqs: Sequence[Req], tree: BasePrefixCache) -> list[Req]:
    """SGLang's ``dfs-weight``: match every waiting request (its ``last_node``), weigh every tree
    node by the waiting requests whose match ends in its subtree, then walk the tree depth first,
    heavier children first (ties: the tree's child order), emitting a node's own requests after its
    subtree's. Requests sharing a hot branch come out together, the hottest branch first."""
    at: dict[Any, list[Req]] = {}
    for req in reqs:
        req.init_next_round_input(tree)  # match_prefix: may split, so last_node ends the match exactly
        at.setdefault(req.last_node, []).append(req)
    root = tree.root
    weight: dict[Any, int] = {}
    for node, rs in at.items():  # each node's count goes to it and every ancestor
        while node is not None:
            weight[node] = weight.get(node, 0) + len(rs)
            if node is root:
                break
            node = getattr(node, "parent", None)
    out: list[Req] = []
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            out.extend(at.get(node, ()))
            continue
        stack.append((node, True))
        children = getattr(node, "children", None) or {}
        kids = [c for c in children.values() if c in weight]  # weight-0 subtrees hold no request
        kids.sort(key=lambda c: -weight[c])  # stable: equal weights keep the tree's order
        stack.extend((c, False) for c in reversed(kids))
    return out
