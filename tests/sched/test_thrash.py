"""Thrash-free preemption: the per-request cap and the min-recompute victim (sched/thrash.py)."""

from __future__ import annotations

import pytest

from radixserve.sched.req import Req
from radixserve.sched.schedule_batch import ForwardMode
from radixserve.sched.thrash import recompute_cost, retract_order
from tests.fakes import drain, expected_tokens, make_scheduler
from tests.sched.policy_helpers import assert_exact, prompt, submit


def test_preemption_cap_stops_thrashing() -> None:
    sched, _, kv = make_scheduler(
        pool_tokens=256, max_running_requests=1, enable_priority_scheduling=True,
        priority_scheduling_preemption_threshold=0, max_preemptions_per_request=2)
    low = submit(sched, "low", prompt(1, 8), 30, priority=0)
    reqs = [low]
    outs = list(sched.step())
    for i in range(3):
        outs += sched.step()  # low is decoding
        assert sched.queues.running.reqs == [low]
        high = submit(sched, f"high{i}", prompt(10 + i, 6), 2, priority=10)
        reqs.append(high)
        outs += sched.step()
        if i < 2:  # preempted: high runs, low waits
            assert low in sched.queues.waiting and low.num_preemptions == i + 1
            while high.finished_reason is None:
                outs += sched.step()
            outs += sched.step()  # low comes back (it keeps its place at the front)
        else:  # capped: low keeps running, high waits for it
            assert sched.queues.running.reqs == [low] and sched.queues.waiting == [high]
    assert low.num_preemptions == 2 and sched.stats.num_preemptions == 2
    outs += drain(sched)
    assert low.finished_time is not None and reqs[-1].first_scheduled_time is not None
    assert_exact(outs, reqs)
    kv.check_invariant()


def _running_trio(policy: str):  # type: ignore[no-untyped-def]
    """r1, r1b share a 20-token cached prefix (3 and 4 own tokens); r2 has 30 tokens of its own.
    All three run with one output each; every free slot is then taken."""
    sched, runner, kv = make_scheduler(pool_tokens=160, retract_decode_steps=1, new_token_ratio_decay_steps=100,
                                       retract_victim_policy=policy)
    p = prompt(7, 20)
    submit(sched, "warm", p, 1)
    drain(sched)
    r1 = submit(sched, "r1", p + prompt(8, 3), 20)
    r1b = submit(sched, "r1b", p + prompt(9, 4), 20)
    r2 = submit(sched, "r2", prompt(10, 30), 20)
    sched.step()
    assert [len(r.output_ids) for r in (r1, r1b, r2)] == [1, 1, 1]
    kv.tree_cache.evict(kv.tree_cache.evictable_size())
    hog = kv.allocator.alloc(kv.available_size())
    return sched, kv, (r1, r1b, r2), hog


def _exact(*reqs: Req) -> None:
    for r in reqs:
        assert r.output_ids == expected_tokens(r.origin_input_ids, r.max_new_tokens), r.rid


def test_min_recompute_victim_vs_sglang() -> None:
    sched, kv, (r1, r1b, r2), hog = _running_trio("min-recompute")
    assert [recompute_cost(r, kv) for r in (r1, r1b, r2)] == [3, 4, 30]
    sched.step()
    assert sched.queues.waiting == [r1]  # the cheapest to recompute
    kv.allocator.free(hog)
    drain(sched)
    _exact(r1, r1b, r2)

    sched, kv, (r1, r1b, r2), hog = _running_trio("sglang")
    sched.step()
    assert sched.queues.waiting == [r2]  # SGLang's: equal outputs, the longest prompt
    kv.allocator.free(hog)
    drain(sched)
    _exact(r1, r1b, r2)


def test_retraction_cap_orders_capped_last() -> None:
    sched, kv, (r1, r1b, r2), hog = _running_trio("min-recompute")
    r1.num_retractions = 3  # at the default cap of 3: retracted only if nothing else is left
    assert retract_order([r1, r1b, r2], kv, "min-recompute", 3)[-1] is r1b
    assert retract_order([r1, r1b, r2], kv, "min-recompute", 3)[0] is r1
    sched.step()
    assert sched.queues.waiting == [r1b]
    kv.allocator.free(hog)
    drain(sched)
    _exact(r1, r1b, r2)


# --- a returned victim keeps its place at the front of its class --------------------------------
def _retracted_victim(cap: int, priorities: bool = False):  # type: ignore[no-untyped-def]
    """``sjf``, one request per prefill. a (2 outputs) and v (1 output, priority 5) decode; every
    free slot is taken; w (priority 5, a smaller job than v) arrives and cannot be admitted; the
    next decode retracts v (fewest outputs); n (priority 5, small) arrives after. With priorities,
    h (10) and lo (1) wait too."""
    kw = dict(enable_priority_scheduling=True, priority_scheduling_preemption_threshold=100) if priorities else {}
    sched, _, kv = make_scheduler(pool_tokens=128, retract_decode_steps=1, schedule_policy="sjf",
                                  prefill_max_requests=1, max_preemptions_per_request=cap, **kw)
    a = submit(sched, "a", prompt(21, 9), 20, priority=5)
    sched.step()
    sched.step()  # a decodes
    v = submit(sched, "v", prompt(22, 7), 20, priority=5)
    sched.step()  # v prefilled
    assert [len(a.output_ids), len(v.output_ids)] == [2, 1]
    kv.tree_cache.evict(kv.tree_cache.evictable_size())
    hog = kv.allocator.alloc(kv.available_size())
    extra = []
    if priorities:
        extra = [submit(sched, "h", prompt(23, 20), 20, priority=10), submit(sched, "lo", prompt(24, 3), 1, priority=1)]
    w = submit(sched, "w", prompt(25, 5), 2, priority=5)
    sched.step()  # no room for w; the decode retracts v
    assert sched.stats.num_retractions == 1 and v.num_retractions == 1 and sched.queues.running.reqs == [a]
    n = submit(sched, "n", prompt(26, 4), 2, priority=5)
    kv.allocator.free(hog)
    return sched, kv, v, w, n, extra


def _admission_order(sched) -> list[str]:  # type: ignore[no-untyped-def]
    """Step until the queue is empty; the requests of each prefill batch in order."""
    order: list[str] = []
    while sched.queues.waiting:
        sched.step()
        b = sched.cur_batch
        if b is not None and b.forward_mode is ForwardMode.EXTEND:
            order += [r.rid for r in b.reqs]
    return order


@pytest.mark.parametrize("cap, front", [(3, True), (1, True), (0, False)])
def test_retracted_request_returns_to_the_front_of_its_class(cap: int, front: bool) -> None:
    sched, kv, v, w, n, _ = _retracted_victim(cap)
    # sjf sizes: n 4 + 2 and w 5 + 2 tokens; v at least 19 (its outputs left)
    assert _admission_order(sched) == (["v", "n", "w"] if front else ["n", "w", "v"])
    drain(sched)
    _exact(v, w, n)


@pytest.mark.parametrize("cap, front", [(3, True), (0, False)])
def test_retracted_request_returns_to_the_front_of_its_priority_class(cap: int, front: bool) -> None:
    sched, kv, v, w, n, (h, lo) = _retracted_victim(cap, priorities=True)
    assert _admission_order(sched) == (["h", "v", "n", "w", "lo"] if front else ["h", "n", "w", "v", "lo"])
    drain(sched)
    _exact(v, w, n, h, lo)


@pytest.mark.parametrize("cap, front", [(3, True), (0, False)])
def test_preempted_request_returns_to_the_front_of_its_class(cap: int, front: bool) -> None:
    """One running slot, ``sjf``. low (priority 0) runs; w (0, a smaller job) waits behind it; high
    (10) preempts low; once high is done, low comes back ahead of w and of n (0, arrived later)."""
    sched, _, kv = make_scheduler(
        pool_tokens=256, max_running_requests=1, schedule_policy="sjf", enable_priority_scheduling=True,
        priority_scheduling_preemption_threshold=0, max_preemptions_per_request=cap)
    low = submit(sched, "low", prompt(31, 8), 12, priority=0)
    sched.step()
    sched.step()
    w = submit(sched, "w", prompt(32, 3), 2, priority=0)
    sched.step()  # same class: no preemption, w waits
    assert sched.queues.running.reqs == [low] and sched.queues.waiting == [w]
    high = submit(sched, "high", prompt(33, 6), 2, priority=10)
    sched.step()
    assert low.num_preemptions == 1 and sched.stats.num_preemptions == 1
    assert sched.queues.waiting == [w, low] and sched.cur_batch is not None and sched.cur_batch.reqs == [high]
    n = submit(sched, "n", prompt(34, 2), 2, priority=0)
    order = _admission_order(sched)
    assert order == (["low", "n", "w"] if front else ["n", "w", "low"])
    drain(sched)
    _exact(low, w, high, n)
