"""Request priorities (seed 000, sections 2.1, 3.1, 4.4): order, direction, defaults, the disabled
mode, preemption (threshold, memory, victim choice), the queue cap, the queue timeout and the
request limits. Every scenario drains, which checks the KV invariant."""

from __future__ import annotations

import sys

import pytest

from radixserve.config import ServerArgs
from radixserve.sched.finish import FINISH_ABORT
from radixserve.sched.req import Req
from radixserve.sched.sampling_params import SamplingParams
from tests.fakes import drain, make_scheduler
from tests.sched.policy_helpers import BatchLog, aborts, assert_exact, prompt, submit

PRIOS = {"a": 5, "b": 10, "c": 10, "d": 1, "e": None}  # submitted in this order (e gives none)


def _first_batch(**kw: object) -> tuple[list[str], dict[str, FINISH_ABORT]]:
    sched, _, _ = make_scheduler(**kw)  # type: ignore[arg-type]
    log = BatchLog(sched)
    reqs = [submit(sched, rid, prompt(i, 6), priority=p) for i, (rid, p) in enumerate(PRIOS.items())]
    outs = drain(sched)
    ab = aborts(outs)
    assert_exact(outs, [r for r in reqs if r.rid not in ab])
    return log.rids(0), ab


def test_priority_first_then_arrival() -> None:
    order, _ = _first_batch(enable_priority_scheduling=True)
    assert order == ["b", "c", "a", "d", "e"]  # larger first; b/c tie by arrival; no priority = least


def test_low_priority_values_first_flips_the_order() -> None:
    order, _ = _first_batch(enable_priority_scheduling=True, schedule_low_priority_values_first=True)
    assert order == ["d", "a", "b", "c", "e"]  # e still last: its default is sys.maxsize


def test_default_priority_value() -> None:
    order, _ = _first_batch(enable_priority_scheduling=True, default_priority_value=7)
    assert order == ["b", "c", "e", "a", "d"]


def test_default_is_the_least_important_value_as_sglang() -> None:
    sched, _, _ = make_scheduler(enable_priority_scheduling=True)
    r = submit(sched, "r", prompt(1, 5))
    assert r.priority == -sys.maxsize - 1
    drain(sched)


@pytest.mark.parametrize("policy", ["fcfs", "lof", "lpm"])
def test_priority_is_ignored_when_disabled(policy: str) -> None:
    order, ab = _first_batch(schedule_policy=policy)
    assert order == ["a", "b", "c", "d", "e"] and not ab


def test_abort_on_priority_when_disabled() -> None:
    order, ab = _first_batch(abort_on_priority_when_disabled=True)
    assert order == ["e"]
    assert set(ab) == {"a", "b", "c", "d"}
    assert ab["a"].status_code == 400 and ab["a"].code == "priority_disabled" and ab["a"].param == "priority"
    assert "--enable-priority-scheduling" in ab["a"].message


def test_a_priority_must_be_an_integer() -> None:
    sched, _, _ = make_scheduler(enable_priority_scheduling=True)
    sched.add_request(Req("x", [1, 2, 3], SamplingParams(max_new_tokens=2), priority="high"))  # type: ignore[arg-type]
    (out,) = drain(sched)
    assert isinstance(out.finished_reason, FINISH_ABORT) and out.finished_reason.param == "priority"


# --- preemption ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("low_first", "running_prio", "new_prio", "preempts"),
    [(False, 0, 10, False), (False, 0, 11, True), (True, 20, 10, False), (True, 20, 9, True)],
)
def test_preemption_threshold(low_first: bool, running_prio: int, new_prio: int, preempts: bool) -> None:
    """A difference equal to the threshold (10) does not preempt; one more does. The victim's KV
    goes to the cache, and it comes back as a 1-token extend."""
    sched, _, _ = make_scheduler(enable_priority_scheduling=True, schedule_low_priority_values_first=low_first,
                                 max_running_requests=1)
    log = BatchLog(sched)
    low = submit(sched, "low", prompt(1, 8), max_new=12, priority=running_prio)
    outs = [o for _ in range(3) for o in sched.step()]  # prefill + 2 decodes: 3 tokens out
    high = submit(sched, "high", prompt(2, 8), max_new=5, priority=new_prio)
    outs += sched.step()
    if preempts:
        assert log.steps[-1] == [("high", 0, 8)]
        assert low.num_preemptions == 1 and sched.stats.num_preemptions == 1
        assert sched.queues.waiting == [low] and low.req_pool_idx is None
    else:
        assert log.rids(-1) == ["low"] and log.modes[-1] == "DECODE"
        assert low.num_preemptions == 0 and sched.queues.waiting == [high]
    outs += drain(sched)
    assert_exact(outs, [low, high])
    if preempts:
        resumed = [s for s in log.steps[4:] if s[0][0] == "low"][0]
        assert resumed == [("low", 10, 1)]  # prompt 8 + 2 computed outputs were cached
        assert log.admissions() == ["low", "high"]


def test_preemption_for_kv_memory() -> None:
    """The pool cannot hold the newcomer next to what the running request reserves; the newcomer
    beats it by more than the threshold, so it is preempted in the same step."""
    sched, _, kv = make_scheduler(pool_tokens=64, enable_priority_scheduling=True)
    log = BatchLog(sched)
    low = submit(sched, "low", prompt(1, 10), max_new=40, priority=0)
    outs = [*sched.step(), *sched.step()]
    high = submit(sched, "high", prompt(2, 10), max_new=30, priority=20)
    outs += sched.step()
    assert log.steps[-1] == [("high", 0, 10)]
    assert low.num_preemptions == 1 and sched.queues.waiting == [low]
    outs += drain(sched)
    assert_exact(outs, [low, high])


def test_no_preemption_for_memory_below_the_threshold() -> None:
    sched, _, _ = make_scheduler(pool_tokens=64, enable_priority_scheduling=True)
    log = BatchLog(sched)
    low = submit(sched, "low", prompt(1, 10), max_new=40, priority=0)
    outs = [*sched.step(), *sched.step()]
    high = submit(sched, "high", prompt(2, 10), max_new=30, priority=10)
    outs += sched.step()
    assert log.rids(-1) == ["low"] and low.num_preemptions == 0
    outs += drain(sched)
    assert_exact(outs, [low, high])


def test_preemption_victim_is_least_important_then_latest() -> None:
    sched, _, _ = make_scheduler(enable_priority_scheduling=True, max_running_requests=3)
    a = submit(sched, "a", prompt(1, 6), max_new=10, priority=0)
    b = submit(sched, "b", prompt(2, 6), max_new=10, priority=0)
    c = submit(sched, "c", prompt(3, 6), max_new=10, priority=5)
    outs = [*sched.step(), *sched.step()]
    n = submit(sched, "n", prompt(4, 6), max_new=4, priority=20)
    outs += sched.step()
    assert [r.num_preemptions for r in (a, b, c)] == [0, 1, 0]
    assert sorted(r.rid for r in sched.queues.running.reqs) == ["a", "c"]
    outs += drain(sched)
    assert_exact(outs, [a, b, c, n])


# --- the queue cap -------------------------------------------------------------------------------


def test_queue_cap_evicts_the_least_important_queued_request() -> None:
    sched, _, _ = make_scheduler(enable_priority_scheduling=True, max_queued_requests=2)
    a = submit(sched, "a", prompt(1, 5), priority=1)
    b = submit(sched, "b", prompt(2, 5), priority=5)
    c = submit(sched, "c", prompt(3, 5), priority=3)  # evicts a
    d = submit(sched, "d", prompt(4, 5), priority=3)  # c is least important now, d no better: refused
    e = submit(sched, "e", prompt(5, 5), priority=9)  # evicts c
    assert sched.queues.waiting == [b, e]
    outs = drain(sched)
    ab = aborts(outs)
    assert set(ab) == {"a", "c", "d"}
    assert (ab["a"].status_code, ab["a"].code) == (429, "queue_full_preempted")
    assert "least important" in ab["a"].message and "priority 3" in ab["a"].message
    assert (ab["d"].status_code, ab["d"].code) == (429, "queue_full")
    assert_exact(outs, [b, e])
    assert all(r.finished() for r in (a, c, d))


@pytest.mark.parametrize(("low_first", "prios", "new", "evicted"), [
    (False, (1, 1), 2, "y"),  # equal priorities: the later one goes
    (True, (5, 1), 3, "x"),  # low values first: 5 is the least important
    (True, (5, 1), 5, None),  # not strictly more important: the newcomer is refused
])
def test_queue_cap_direction_and_ties(low_first: bool, prios: tuple[int, int], new: int, evicted: str | None) -> None:
    sched, _, _ = make_scheduler(enable_priority_scheduling=True, schedule_low_priority_values_first=low_first,
                                 max_queued_requests=2)
    submit(sched, "x", prompt(1, 5), priority=prios[0])
    submit(sched, "y", prompt(2, 5), priority=prios[1])
    submit(sched, "z", prompt(3, 5), priority=new)
    ab = aborts(drain(sched))
    assert set(ab) == {evicted or "z"}


def test_queue_cap_without_priority_refuses_the_newcomer() -> None:
    sched, _, _ = make_scheduler(max_queued_requests=1)
    submit(sched, "x", prompt(1, 5), priority=1)
    submit(sched, "y", prompt(2, 5), priority=100)
    assert set(aborts(drain(sched))) == {"y"}


# --- queue timeout, request limits --------------------------------------------------------------


def test_queue_timeout_aborts_a_request_never_scheduled() -> None:
    now = [100.0]
    sched, _, _ = make_scheduler(queue_timeout=5.0, max_running_requests=1)
    sched.clock.source = lambda: now[0]
    r1 = submit(sched, "r1", prompt(1, 6), max_new=30)
    r2 = submit(sched, "r2", prompt(2, 6), max_new=3)
    outs = list(sched.step())
    now[0] = 105.0  # waited exactly 5 s: not yet
    outs += sched.step()
    assert r2 in sched.queues.waiting
    now[0] = 105.5
    outs += sched.step()
    assert r2 not in sched.queues.waiting
    ab = aborts(outs)
    assert set(ab) == {"r2"} and (ab["r2"].status_code, ab["r2"].code) == (503, "queue_timeout")
    assert "queue_timeout=5.0" in ab["r2"].message
    outs += drain(sched)
    assert_exact(outs, [r1])


def test_max_running_and_prefill_max_requests() -> None:
    sched, _, _ = make_scheduler(max_running_requests=2, prefill_max_requests=1)
    log = BatchLog(sched)
    reqs = [submit(sched, f"r{i}", prompt(i, 6), max_new=3 + i) for i in range(5)]
    outs = drain(sched)
    assert all(len(s) <= 2 for s in log.steps)
    assert all(len(s) == 1 for s, m in zip(log.steps, log.modes, strict=True) if m == "EXTEND")
    assert log.admissions() == [f"r{i}" for i in range(5)]
    assert_exact(outs, reqs)


def test_config_validation() -> None:
    for bad in ({"queue_timeout": 0}, {"lpm_fallback_threshold": -1}, {"max_running_requests": 0},
                {"scheduler": "unified", "schedule_policy": "lpm"},
                {"scheduler": "unified", "enable_priority_scheduling": True},
                {"scheduling_policy": "priority"}, {"scheduler": "vllm"}):
        with pytest.raises(ValueError):
            ServerArgs(**bad)  # type: ignore[arg-type]
