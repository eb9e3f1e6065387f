"""``IncrementalLPM``: lpm's queue order, updated by what changed instead of re-sorted each round.

lpm sorts the waiting queue *stably* by its key (``prefix_match.lpm_sort_keys``: longest cached
prefix, arrival, in-batch pushes to the back). Stability makes the order depend on history: among
equal keys, the queue's previous order decides, and the queue is the last order minus the
admitted head plus newcomers at the end. Re-sorting 10k requests in Python costs milliseconds per
round even when only a handful of keys changed, so this class keeps the sorted list and, per
round, only removes and re-inserts what changed. Each request carries a total sort key (its
``LPMState.order``) that reproduces the stable sort exactly:

    F = (key, d, d * round, F_before)

- a request whose key did not change keeps its F, so the relative order of those is kept;
- one whose key changed this round from ``old`` gets ``d = -1`` if ``old < key`` (it stood before
  everyone who already had ``key``, and after anyone who joined ``key`` from below in an earlier
  round), ``d = +1`` if ``old > key`` (after them, and after earlier joiners from above); two that
  changed in the same round keep their previous relative order through ``F_before``;
- a newcomer is a join from above (``+inf``), ordered among the round's newcomers by arrival in
  the queue: ``(key, 1, round, (inf, seq))``;
- after a full sort (the first round, or any round where the queue was changed in another way:
  an abort from the middle, aging's re-sort, priorities), ``F = (key, 0, 0, position)``.

So ordering by F is the same list as the stable sort of the previous list, round after round.

The in-batch check (SGLang's in-batch prefix caching) is kept per group of requests sharing
their first T tokens: the first candidate of a group in queue order is kept, the others go to the
back. A group's outcome can only change when one of its members changed (joined, left, or its
key changed), so only those groups are looked at.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from operator import attrgetter
from typing import Any

from radixserve.mem.radix_cache import RadixCache
from radixserve.sched.policies.prefix_match import (
    _BACK,
    _SHIFT,
    LPM_STALE,
    PrefixLengthCache,
    ensure_states,
    lpm_sort_keys,
)
from radixserve.sched.req import Req

_INF = float("inf")
_get_order = attrgetter("policy_state.order")
_get_state = attrgetter("policy_state")


class IncrementalLPM:
    def __init__(self, matches: PrefixLengthCache) -> None:
        self.matches = matches
        self.reset()

    def reset(self) -> None:
        """Forget the kept order: the next round sorts in full."""
        for r in getattr(self, "_out", None) or ():
            r.policy_state.order = None
        self._out: list[Req] | None = None
        self._params: tuple[Any, ...] = ()
        self._round = 0
        self._seq = 0
        self._groups: dict[Any, set[Req]] = {}
        self._kept: dict[Any, Req | None] = {}
        self._touched: set[Any] = set()  # groups that lost a member since the last round

    # --- one round ------------------------------------------------------------------------------
    def order(self, waiting: list[Req], tree: RadixCache, check: int, t: int) -> list[Req]:
        self._round += 1
        params = (tree.root, check, t)
        prev = self._out
        tail_start = self._match_prev(waiting, prev) if prev is not None and params == self._params else None
        if tail_start is None:
            out = self._full(waiting, tree, check, t)
        else:
            assert prev is not None
            out = self._update(waiting, prev, tail_start, tree, check, t)
        self._params = (tree.root, check, t)
        self._out = out
        return list(out)  # the scheduler may extend the list it gets

    def _match_prev(self, waiting: list[Req], prev: list[Req]) -> int | None:
        """Where the newcomers start in ``waiting`` if it is ``prev`` minus a head plus newcomers
        (requests never ordered: no order yet, or no ``LPMState`` at all); None otherwise."""
        j = len(prev)
        if waiting and prev:
            w0 = waiting[0]
            if w0.policy_state is not None and w0.policy_state.order is not None:
                try:
                    j = prev.index(w0)
                except ValueError:
                    return None
        m = len(prev) - j
        if waiting[:m] != prev[j:]:  # identity compares, in C
            return None
        ensure_states(waiting[m:])
        if any(r.policy_state.order is not None for r in waiting[m:]):
            return None
        for r in prev[:j]:  # admitted (or otherwise taken from the head)
            self._leave(r)
        del prev[:j]
        return m

    def _leave(self, r: Req) -> None:
        r.policy_state.order = None
        if self._groups:
            g = r.policy_state.group
            members = self._groups.get(g)
            if members is not None:
                members.discard(r)
                self._touched.add(g)

    # --- full sort ------------------------------------------------------------------------------
    def _full(self, waiting: list[Req], tree: RadixCache, check: int, t: int) -> list[Req]:
        if self._out is not None:
            for s in map(_get_state, self._out):
                s.order = None
        keys = lpm_sort_keys(waiting, tree, self.matches, check, t)
        idx = sorted(range(len(waiting)), key=keys.__getitem__)
        out = list(map(waiting.__getitem__, idx))
        states = list(map(_get_state, out))
        groups: dict[Any, set[Req]] = {}
        kept: dict[Any, Req | None] = {}
        self._groups, self._kept, self._touched = groups, kept, set()
        if t <= 0:
            for pos, (s, k) in enumerate(zip(states, map(keys.__getitem__, idx), strict=True)):
                s.order = (k, 0, 0, pos)
            return out
        # one pass in queue order: the first candidate met in a group is the one
        # ``_first_candidate`` would pick (the smallest order, i.e. the smallest position)
        floor = -check * (1 << _SHIFT)
        for pos, (r, s, k) in enumerate(zip(out, states, map(keys.__getitem__, idx), strict=True)):
            s.order = (k, 0, 0, pos)
            g = s.group
            members = groups.get(g)
            if members is None:
                groups[g] = {r}
                kept[g] = r if s.key >= floor else None
            else:
                members.add(r)
                if kept[g] is None and s.key >= floor:
                    kept[g] = r
        return out

    # --- incremental ----------------------------------------------------------------------------
    def _update(self, waiting: list[Req], out: list[Req], tail_start: int, tree: RadixCache, check: int,
                t: int) -> list[Req]:
        matches = self.matches
        rnd = self._round
        floor = -check * (1 << _SHIFT)
        changed: dict[int, Req] = {}  # old members whose base key may have changed
        for r in matches.dirty:
            if r.policy_state.order is not None and r.policy_state.key == LPM_STALE:
                matches.refresh(r, tree)
                changed[id(r)] = r
        matches.dirty.clear()
        tail = waiting[tail_start:]
        pre: dict[int, Any] = {}  # newcomers' place in this round's queue: after everyone, in order
        for r in tail:
            matches.refresh(r, tree)
            self._seq += 1
            pre[id(r)] = (_INF, self._seq)
        # the effective key of every old member whose key may move, and of the newcomers
        new_eff: dict[int, int] = {}
        if t > 0:
            touched, self._touched = self._touched, set()
            for r in changed.values():
                touched.add(r.policy_state.group)
            for r in tail:
                self._groups.setdefault(r.policy_state.group, set()).add(r)
                touched.add(r.policy_state.group)
            for g in touched:
                members = self._groups.get(g)
                if not members:
                    self._groups.pop(g, None)
                    self._kept.pop(g, None)
                    continue
                old_kept = self._kept.get(g)
                kept = self._kept[g] = _first_candidate(members, floor, pre)
                for k_req in (old_kept, kept):
                    if k_req is not None and k_req.policy_state.order is not None:
                        changed[id(k_req)] = k_req
                for r in members:
                    if id(r) in changed or r.policy_state.order is None:
                        k = r.policy_state.key
                        new_eff[id(r)] = k + _BACK if (k >= floor and r is not kept) else k
        else:
            for r in changed.values():
                new_eff[id(r)] = r.policy_state.key
            for r in tail:
                new_eff[id(r)] = r.policy_state.key
        # re-insert the old members whose effective key moved
        moved: list[Req] = []
        for r in changed.values():
            f = r.policy_state.order
            eff = new_eff.get(id(r), f[0])
            if eff == f[0]:
                continue
            i = bisect_left(out, f, key=_get_order)
            assert out[i] is r
            del out[i]
            d = -1 if f[0] < eff else 1
            r.policy_state.order = (eff, d, d * rnd, f)
            moved.append(r)
        for r in tail:
            r.policy_state.order = (new_eff[id(r)], 1, rnd, pre[id(r)])
            moved.append(r)
        for r in moved:
            insort(out, r, key=_get_order)
        return out


def _first_candidate(members: set[Req], floor: int, pre: dict[int, Any]) -> Req | None:
    """The group's request that comes first in this round's queue among those the in-batch check
    looks at (cached prefix short enough: key >= floor). A member's place is its order
    from the last round; newcomers' places are in ``pre`` (after everyone else)."""
    best: Req | None = None
    best_f: Any = None
    for r in members:
        if r.policy_state.key < floor:
            continue
        f = pre.get(id(r)) or r.policy_state.order
        if best is None or f < best_f:
            best, best_f = r, f
    return best
