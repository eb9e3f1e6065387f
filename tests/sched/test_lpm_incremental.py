"""lpm's incremental order (``sched.lpm_order``) and watcher-kept prefix lengths equal a full
stable re-sort over fresh matches, round after round."""

from __future__ import annotations

import random

import pytest

from radixserve.mem.allocator import TokenToKVPoolAllocator
from radixserve.mem.base_cache import RadixKey
from radixserve.mem.kv_pool import ReqToTokenPool
from radixserve.mem.radix_cache import RadixCache
from radixserve.sched.policies.lpm_order import IncrementalLPM
from radixserve.sched.policies.prefix_match import _BACK, _SHIFT, PrefixLengthCache, _deprioritized
from radixserve.sched.req import Req
from radixserve.sched.sampling_params import SamplingParams


def _fresh_order(reqs: list[Req], tree: RadixCache, check: int, t: int) -> list[Req]:
    """The definition: match every request from the root, in-batch check in queue order, stable sort."""
    keys = []
    for r in reqs:
        ids = r.origin_input_ids if not r.output_ids else r.fill_ids
        _, _, n = tree.peek_prefix(ids, r.extra_key, limit=len(ids) - 1)
        keys.append(-n * (1 << _SHIFT) + int(r.arrival_time * 1e6))
    if t > 0:
        cand = [i for i, k in enumerate(keys) if k >= -check * (1 << _SHIFT)]
        for i in _deprioritized(reqs, cand, t):
            keys[i] += _BACK
    return [reqs[i] for i in sorted(range(len(reqs)), key=keys.__getitem__)]


@pytest.mark.parametrize("page_size", [1, 2])
@pytest.mark.parametrize("t", [0, 3])
def test_incremental_order_equals_full_stable_sort(page_size: int, t: int) -> None:
    rng = random.Random(page_size * 10 + t)
    alloc = TokenToKVPoolAllocator(4096, page_size)
    tree = RadixCache(ReqToTokenPool(1, 8), alloc)
    inc = IncrementalLPM(PrefixLengthCache())
    check = 4

    def seq(n: int) -> list[int]:
        return [rng.randrange(1, 4) for _ in range(n)]  # tiny alphabet: lots of sharing and ties

    def insert(ids: list[int]) -> None:
        ids = ids[: len(ids) - len(ids) % page_size]
        if ids and alloc.available_size() >= len(ids):
            vals = alloc.alloc(len(ids))
            alloc.free(vals[: tree.insert(RadixKey(ids), vals)])

    counter = 0

    def new_req() -> Req:
        nonlocal counter
        counter += 1
        return Req(f"r{counter}", seq(rng.randrange(2, 14)), SamplingParams(max_new_tokens=4),
                   arrival_time=float(rng.randrange(3)))

    ours: list[Req] = [new_req() for _ in range(30)]
    ref = list(ours)
    fulls = 0
    for rnd in range(250):
        for _ in range(rng.randrange(0, 4)):
            op = rng.random()
            if op < 0.45:
                insert(seq(rng.randrange(1, 14)) if rng.random() < 0.5 else rng.choice(ref or [new_req()]).fill_ids)
            elif op < 0.7:
                tree.evict(rng.randrange(1, 30))
            else:
                tree.match_prefix(RadixKey(seq(rng.randrange(1, 12))))  # splits
        if rnd % 50 == 49:
            tree.evict(tree.evictable_size())
            tree.reset()
        out = inc.order(ours, tree, check, t)
        want = _fresh_order(ref, tree, check, t)
        assert out == want, rnd
        fulls += inc._out is not None and all(r.policy_state.order[1] == 0 for r in inc._out)
        # the scheduler: admit a head, sometimes abort one from the middle, retract one, add some
        k = rng.randrange(0, 4)
        ours, ref = out[k:], want[k:]
        if ours and rng.random() < 0.05:
            i = rng.randrange(len(ours))
            del ours[i], ref[i]
        if rng.random() < 0.1 and ours:  # a retracted request comes back with its output as prompt
            r = Req(f"x{rnd}", seq(rng.randrange(2, 10)), SamplingParams(max_new_tokens=4))
            r.output_ids.append(rng.randrange(1, 4))
            r.reset_for_retract()
            ours.append(r)
            ref.append(r)
        for _ in range(rng.randrange(0, 4)):
            r = new_req()
            ours.append(r)
            ref.append(r)
    assert fulls < 60  # most rounds were incremental


def test_split_then_insert_lengthens_a_waiting_match() -> None:
    """A request matching part way into a node sees its match grow when another prompt splits that
    node at the same point and inserts the request's next token (missed before the watchers)."""
    alloc = TokenToKVPoolAllocator(64, 1)
    tree = RadixCache(ReqToTokenPool(1, 8), alloc)
    cache = PrefixLengthCache()
    tree.insert(RadixKey([1, 2, 3, 4, 5]), alloc.alloc(5))
    req = Req("a", [1, 2, 3, 9, 9, 7])
    assert cache.prefix_lens([req], tree) == [3]
    vals = alloc.alloc(6)
    alloc.free(vals[: tree.insert(RadixKey([1, 2, 3, 9, 9, 8]), vals)])  # split after [1, 2, 3]
    assert cache.prefix_lens([req], tree) == [5]


def test_lpm_keeps_its_state_in_the_slot_it_owns() -> None:
    """lpm's per-request state is an ``LPMState`` in ``Req.policy_state``: made when lpm first
    orders the request, reset (not replaced) when the request is retracted, its match dropped
    when the request is admitted; the scheduler's ``Req`` knows none of its fields."""
    from radixserve.sched.policies.base import PolicyContext
    from radixserve.sched.policies.lpm import LongestPrefixMatch
    from radixserve.sched.policies.prefix_match import LPM_STALE, LPMState

    assert not any(name.startswith("lpm") or "match_cache" in name for name in vars(Req("x", [1], SamplingParams())))
    alloc = TokenToKVPoolAllocator(256, 1)
    tree = RadixCache(ReqToTokenPool(1, 8), alloc)
    vals = alloc.alloc(6)
    tree.insert(RadixKey([1, 2, 3, 4, 5, 6]), vals)
    reqs = [Req(f"r{i}", ids, SamplingParams(max_new_tokens=4), arrival_time=float(i))
            for i, ids in enumerate([[9, 9, 9], [1, 2, 3, 7], [1, 2, 3, 4, 5, 8]])]
    assert all(r.policy_state is None for r in reqs)
    lpm = LongestPrefixMatch()
    order = lpm.order(list(reqs), PolicyContext(prefix_tree=tree, now=0.0, lpm_fallback_threshold=0))
    assert [r.rid for r in order] == ["r2", "r1", "r0"]  # longest cached prefix first
    states = [r.policy_state for r in reqs]
    assert all(isinstance(s, LPMState) and s.match is not None and s.order is not None for s in states)
    lpm.on_admitted([reqs[2]])
    assert reqs[2].policy_state.match is None and reqs[1].policy_state.match is not None
    reqs[1].reset_for_retract()
    assert reqs[1].policy_state is states[1]
    assert (states[1].key, states[1].order, states[1].match, states[1].group) == (LPM_STALE, None, None, None)
