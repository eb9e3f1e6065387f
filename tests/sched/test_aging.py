"""Aging composes with every policy: a cache-cold request under a stream of cache hits is admitted
by --priority-aging-horizon (fake clock); --priority-aging-rate; sjf; the starvation counter."""

from __future__ import annotations

import pytest

from radixserve.sched.core import SchedulerCore
from radixserve.sched.req import Req
from tests.fakes import drain, expected_tokens, make_scheduler
from tests.sched.policy_helpers import prompt, submit


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


HOT = prompt(1, 64)


def _stream(policy: str, steps: int = 20, **kw: object) -> tuple[SchedulerCore, Req, list[Req]]:
    """Each second two cache hits (64 cached tokens + 8 new) arrive and one prefill round admits
    two requests; the cold request (40 uncached tokens) arrives first."""
    sched, _, kv = make_scheduler(pool_tokens=1024, schedule_policy=policy, prefill_max_requests=2,
                                  lpm_fallback_threshold=0, starvation_threshold=3.0, **kw)
    clock = Clock()
    sched.clock.source = clock
    submit(sched, "warm", HOT, 1)
    drain(sched)
    cold = submit(sched, "cold", prompt(2, 40), 1)
    reqs = [cold]
    for step in range(steps):
        for j in range(2):
            reqs.append(submit(sched, f"hot{step}-{j}", HOT + prompt(100 + 2 * step + j, 8), 1))
        sched.step()
        clock.t += 1.0
    return sched, cold, reqs


def _finish(sched: SchedulerCore, reqs: list[Req]) -> None:
    drain(sched)
    for r in reqs:
        assert r.output_ids == expected_tokens(r.origin_input_ids, 1), r.rid


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight", "sjf"])
def test_cold_request_starves_without_aging(policy: str) -> None:
    sched, cold, reqs = _stream(policy)
    assert cold.first_scheduled_time is None and cold in sched.queues.waiting
    _finish(sched, reqs)
    assert sched.stats.num_starved == 1  # admitted only once the stream stopped


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight", "sjf", "fcfs"])
def test_horizon_bounds_the_wait(policy: str) -> None:
    sched, cold, reqs = _stream(policy, priority_aging_horizon=5.0)
    assert cold.first_scheduled_time is not None and cold.queue_entry_time is not None
    assert cold.first_scheduled_time - cold.queue_entry_time <= 5.0
    if policy != "fcfs":
        assert cold.first_scheduled_time - cold.queue_entry_time == 5.0  # exactly when due
        assert sched.stats.num_starved == 1
    # the hot stream itself is never held back more than the horizon either
    waits = [r.first_scheduled_time - r.queue_entry_time for r in reqs if r.first_scheduled_time is not None]
    assert max(waits) <= 5.0
    _finish(sched, reqs)


def test_aging_rate_lets_the_cold_request_in() -> None:
    sched, cold, reqs = _stream("lpm", priority_aging_rate=1.0)
    assert cold.first_scheduled_time is not None and cold.queue_entry_time is not None
    assert cold.first_scheduled_time - cold.queue_entry_time == 1.0  # one unit ahead of the newcomers
    _finish(sched, reqs)


def test_aging_rate_adds_to_priority() -> None:
    """Priority 0 waiting 3 s at 1 unit/s outranks a fresh priority 2."""
    sched, _, _ = make_scheduler(enable_priority_scheduling=True, priority_aging_rate=1.0, prefill_max_requests=1)
    clock = Clock()
    sched.clock.source = clock
    old = submit(sched, "old", prompt(3, 8), 1, priority=0)
    clock.t += 3.0
    new = submit(sched, "new", prompt(4, 8), 1, priority=2)
    sched.step()
    assert old.first_scheduled_time is not None and new.first_scheduled_time is None
    drain(sched)
    # without the wait, the fresh one goes first
    sched, _, _ = make_scheduler(enable_priority_scheduling=True, priority_aging_rate=1.0, prefill_max_requests=1)
    sched.clock.source = clock
    old = submit(sched, "old", prompt(3, 8), 1, priority=0)
    clock.t += 1.0
    new = submit(sched, "new", prompt(4, 8), 1, priority=2)
    sched.step()
    assert new.first_scheduled_time is not None and old.first_scheduled_time is None
    drain(sched)


def test_sjf_orders_by_uncached_prompt_plus_output() -> None:
    sched, _, _ = make_scheduler(pool_tokens=512, schedule_policy="sjf", prefill_max_requests=1)
    p = prompt(5, 30)
    submit(sched, "warm", p, 1)
    drain(sched)
    a = submit(sched, "long", prompt(6, 20), 2)  # 20 + 2
    b = submit(sched, "cached", p + [7], 4)  # 1 uncached + 4
    c = submit(sched, "short-out", prompt(8, 10), 1)  # 10 + 1
    d = submit(sched, "long-out", prompt(9, 5), 40)  # 5 + 40
    order = []
    while sched.has_work():
        sched.step()
        for r in (a, b, c, d):
            if r.first_scheduled_time is not None and r not in order:
                order.append(r)
    assert order == [b, c, a, d]
    drain(sched)


def _aged_victim_setup(**kw: object) -> tuple[SchedulerCore, Clock, Req]:
    sched, _, _ = make_scheduler(enable_priority_scheduling=True, max_running_requests=1, **kw)
    clock = Clock()
    sched.clock.source = clock
    low = submit(sched, "low", prompt(1, 8), 12, priority=0)
    clock.t += 6.0  # it waited 6 s before it got in
    sched.step()
    sched.step()
    return sched, clock, low


def test_aged_running_request_is_not_preempted_by_a_fresh_arrival() -> None:
    """Past the horizon a running request outranks every newcomer for preemption; without aging
    the same newcomer (priority 100 vs 0) preempts it."""
    sched, _, low = _aged_victim_setup(priority_aging_horizon=5.0)
    high = submit(sched, "high", prompt(2, 8), 4, priority=100)
    sched.step()
    assert low.num_preemptions == 0 and sched.queues.waiting == [high]
    drain(sched)
    sched2, _, low2 = _aged_victim_setup()
    submit(sched2, "high", prompt(2, 8), 4, priority=100)
    sched2.step()
    assert low2.num_preemptions == 1
    drain(sched2)


def test_aging_rate_counts_toward_the_preemption_threshold() -> None:
    """6 s at 2 units/s: the running request ranks 12 units better, so a newcomer 20 above it is
    only 8 above its aged rank, under the threshold of 10; one 23 above (11 net) preempts."""
    sched, _, low = _aged_victim_setup(priority_aging_rate=2.0)
    submit(sched, "mid", prompt(2, 8), 4, priority=20)
    sched.step()
    assert low.num_preemptions == 0
    submit(sched, "top", prompt(3, 8), 4, priority=23)
    sched.step()
    assert low.num_preemptions == 1
    drain(sched)
