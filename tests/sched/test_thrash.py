"""Thrash-free preemption: the per-request cap and the min-recompute victim (sched/thrash.py)."""

from __future__ import annotations

from radixserve.sched.req import Req
from radixserve.sched.thrash import recompute_cost, retract_order
from tests.fakes import drain, expected_tokens, make_scheduler
from tests.sched.policy_helpers import assert_exact, prompt, submit


def test_preemption_cap_stops_thrashing() -> None:
    sched, _, kv = make_scheduler(
        pool_tokens=256, max_running_requests=1, enable_priority_scheduling=True,
        priority_scheduling_preemption_threshold=0, max_preemptions_per_request=2)
    low = submit(sched, "low", prompt(1, 8), 30, priority=0)
    reqs = [low]
    outs = sched.step()
    for i in range(3):
        outs += sched.step()  # low is decoding
        assert sched.running_batch.reqs == [low]
        high = submit(sched, f"high{i}", prompt(10 + i, 6), 2, priority=10)
        reqs.append(high)
        outs += sched.step()
        if i < 2:  # preempted: high runs, low waits
            assert low in sched.waiting_queue and low.num_preemptions == i + 1
            while high.finished_reason is None:
                outs += sched.step()
            outs += sched.step()  # low comes back (it keeps its place at the front)
        else:  # capped: low keeps running, high waits for it
            assert sched.running_batch.reqs == [low] and sched.waiting_queue == [high]
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
    assert [recompute_cost(sched, r) for r in (r1, r1b, r2)] == [3, 4, 30]
    sched.step()
    assert sched.waiting_queue == [r1]  # the cheapest to recompute
    kv.allocator.free(hog)
    drain(sched)
    _exact(r1, r1b, r2)

    sched, kv, (r1, r1b, r2), hog = _running_trio("sglang")
    sched.step()
    assert sched.waiting_queue == [r2]  # SGLang's: equal outputs, the longest prompt
    kv.allocator.free(hog)
    drain(sched)
    _exact(r1, r1b, r2)


def test_retraction_cap_orders_capped_last() -> None:
    sched, kv, (r1, r1b, r2), hog = _running_trio("min-recompute")
    r1.num_retractions = 3  # at the default cap of 3: retracted only if nothing else is left
    assert retract_order(sched, [r1, r1b, r2])[-1] is r1b
    assert retract_order(sched, [r1, r1b, r2])[0] is r1
    sched.step()
    assert sched.waiting_queue == [r1b]
    kv.allocator.free(hog)
    drain(sched)
    _exact(r1, r1b, r2)
