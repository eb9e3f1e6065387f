"""``--scheduler unified`` (vLLM V1, seed 002): exact per-step token counts under the budget, the
long-prefill cap, mixed prefill + decode forwards, prefix caching on admission, the request cap,
and preemption by recompute (FCFS: the last running; priority: the least important latest
arrival; the victim to the front; no admission in a step that preempted). Every scenario drains,
which checks the KV invariant."""

from __future__ import annotations

import pytest

from radixserve.config import ServerArgs
from radixserve.sched.build import build_scheduler as factory
from radixserve.sched.core import SchedulerCore
from radixserve.sched.scheduler import PrefillFirst
from radixserve.sched.unified_scheduler import TokenBudget
from tests.fakes import EchoRunner, drain, make_scheduler
from tests.sched.policy_helpers import BatchLog, assert_exact, prompt, submit


def test_factory_picks_the_builder() -> None:
    s, _, kv = make_scheduler()
    assert type(s) is SchedulerCore and type(s.builder) is PrefillFirst
    u = factory(ServerArgs(scheduler="unified"), EchoRunner(), kv, context_len=512)
    assert type(u.builder) is TokenBudget


def test_three_long_prompts_chunked_under_the_token_budget() -> None:
    sched, _, _ = make_scheduler(pool_tokens=1024, scheduler="unified", max_num_batched_tokens=64)
    log = BatchLog(sched)
    reqs = [submit(sched, rid, prompt(i, 100), max_new=3) for i, rid in enumerate("ABC")]
    outs = drain(sched)
    assert log.steps == [
        [("A", 0, 64)],
        [("A", 64, 36), ("B", 0, 28)],
        [("A", 100, 1), ("B", 28, 63)],  # A decodes while B's prompt goes on: one forward
        [("A", 101, 1), ("B", 91, 9), ("C", 0, 54)],
        [("B", 100, 1), ("C", 54, 46)],
        [("B", 101, 1), ("C", 100, 1)],
        [("C", 101, 1)],
    ]
    assert log.modes == ["MIXED"] * 5 + ["DECODE"] * 2
    assert_exact(outs, reqs)


def test_long_prefill_token_threshold_caps_one_requests_chunk() -> None:
    sched, _, _ = make_scheduler(pool_tokens=1024, scheduler="unified", max_num_batched_tokens=64,
                                 long_prefill_token_threshold=32)
    log = BatchLog(sched)
    reqs = [submit(sched, rid, prompt(i, 100), max_new=3) for i, rid in enumerate("ABC")]
    outs = drain(sched)
    assert log.extend_lens() == [[32, 32], [32, 32], [32, 32], [4, 4, 32], [1, 1, 32], [1, 1, 32], [4], [1], [1]]
    assert_exact(outs, reqs)


def test_prefix_cache_on_admission_and_max_num_seqs() -> None:
    sched, _, _ = make_scheduler(pool_tokens=1024, scheduler="unified", max_num_seqs=2)
    log = BatchLog(sched)
    shared = prompt(1, 30)
    first = submit(sched, "first", shared + [5, 6], max_new=2)
    outs = list(sched.step())
    reqs = [submit(sched, f"r{i}", shared + prompt(10 + i, 4), max_new=3) for i in range(3)]
    outs += drain(sched)
    assert all(r.cached_tokens == 30 for r in reqs)
    assert log.steps[1] == [("first", 32, 1), ("r0", 30, 4)]  # 2 running at most: r1 waits
    assert max(len(s) for s in log.steps) == 2
    assert_exact(outs, [first, *reqs])


def _run_until_preemption(sched: SchedulerCore, log: BatchLog) -> list:  # type: ignore[type-arg]
    outs = []
    for _ in range(200):
        outs += sched.step()
        if sched.stats.num_preemptions:
            return outs
    raise AssertionError("no preemption happened")


@pytest.mark.parametrize(("policy", "victim"), [("fcfs", "C"), ("priority", "B")])
def test_preemption_victim(policy: str, victim: str) -> None:
    """A and B run; C is admitted a step later (running order A, B, C). The pool runs out while
    they decode: FCFS preempts the last running (C); priority the least important (largest value)
    latest arrival, B (9), though it is in the middle. D waits (max_num_seqs=3); in the step that
    preempted, nobody is admitted, and the victim goes in front of D."""
    sched, _, _ = make_scheduler(pool_tokens=64, scheduler="unified", scheduling_policy=policy, max_num_seqs=3)
    log = BatchLog(sched)
    a = submit(sched, "A", prompt(1, 16), max_new=20, priority=5)
    b = submit(sched, "B", prompt(2, 16), max_new=20, priority=9)
    outs = list(sched.step())
    c = submit(sched, "C", prompt(3, 16), max_new=20, priority=1)
    d = submit(sched, "D", prompt(4, 4), max_new=2, priority=0 if policy == "fcfs" else 9)
    outs += _run_until_preemption(sched, log)
    assert sched.stats.num_preemptions == 1
    assert [r.num_preemptions for r in (a, b, c)] == [r.rid == victim for r in (a, b, c)]
    assert sched.queues.waiting[0].rid == victim and d in sched.queues.waiting
    assert sorted(log.rids(-1)) == sorted({"A", "B", "C"} - {victim})  # no admission this step
    assert log.admissions() == ["A", "B", "C"]
    outs += drain(sched)
    assert_exact(outs, [a, b, c, d])


def test_priority_orders_the_waiting_queue_vllm_style() -> None:
    """Under --scheduling-policy priority a smaller value is more important (vLLM); no priority = 0."""
    sched, _, _ = make_scheduler(scheduler="unified", scheduling_policy="priority")
    log = BatchLog(sched)
    reqs = [submit(sched, rid, prompt(i, 6), priority=p) for i, (rid, p) in enumerate(
        [("a", 5), ("b", -1), ("c", None), ("d", 5), ("e", 2)])]
    outs = drain(sched)
    assert log.rids(0) == ["b", "c", "e", "a", "d"]
    assert_exact(outs, reqs)


def test_fcfs_ignores_priorities_and_aborts_and_timeouts_still_apply() -> None:
    now = [0.0]
    sched, _, _ = make_scheduler(scheduler="unified", max_num_seqs=1, queue_timeout=2.0)
    sched.clock.source = lambda: now[0]
    log = BatchLog(sched)
    submit(sched, "a", prompt(1, 6), max_new=6, priority=0)
    b = submit(sched, "b", prompt(2, 6), max_new=6, priority=-5)
    c = submit(sched, "c", prompt(3, 6), max_new=6)
    outs = list(sched.step())
    assert sched.abort_request("a")
    now[0] = 1.0
    outs += sched.step()  # a released; b admitted
    now[0] = 3.5
    outs += drain(sched)  # c waited 3.5 s: aborted
    assert log.admissions() == ["a", "b"]
    fin = {o.rid: o.finished_reason for o in outs if o.finished_reason is not None}
    assert getattr(fin["a"], "code", None) == "aborted" and getattr(fin["c"], "code", None) == "queue_timeout"
    assert_exact(outs, [b])
    assert c.finished()
