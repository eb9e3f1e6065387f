"""edf ordering and --deadline-admission (sched/deadline.py)."""

from __future__ import annotations

from radixserve.sched.core import SchedulerCore
from radixserve.sched.finish import FINISH_ABORT
from radixserve.sched.req import Req
from radixserve.sched.sampling_params import SamplingParams
from tests.fakes import drain, expected_tokens, make_scheduler
from tests.sched.policy_helpers import prompt


class Clock:
    def __init__(self) -> None:
        self.t = 50.0

    def __call__(self) -> float:
        return self.t


def add(sched: SchedulerCore, rid: str, n: int, deadline: float | None, max_new: int = 2, arrival: float = 0.0) -> Req:
    req = Req(rid, prompt(hash(rid) % 10000, n), SamplingParams(max_new_tokens=max_new), arrival_time=arrival)
    req.deadline = deadline  # as the server and the simulator set it
    sched.add_request(req)
    return req


def test_edf_order_no_deadline_last_fcfs() -> None:
    sched, _, _ = make_scheduler(schedule_policy="edf", prefill_max_requests=1)
    clock = Clock()
    clock.t = 0.0  # every deadline below is still ahead
    sched.clock.source = clock
    reqs = [
        add(sched, "none1", 8, None, arrival=0.0),
        add(sched, "late", 8, 9.0, arrival=1.0),
        add(sched, "none2", 8, None, arrival=2.0),
        add(sched, "early", 8, 3.0, arrival=3.0),
        add(sched, "mid", 8, 5.0, arrival=4.0),
    ]
    order: list[str] = []
    while sched.has_work():
        sched.step()
        order += [r.rid for r in reqs if r.first_scheduled_time is not None and r.rid not in order]
    assert order == ["early", "mid", "late", "none1", "none2"]
    drain(sched)
    for r in reqs:
        assert r.output_ids == expected_tokens(r.origin_input_ids, 2)


def test_edf_puts_a_request_that_already_missed_behind_those_that_can_still_make_it() -> None:
    """No domino: a late request (its deadline passed while it waited) would push every request
    behind it past its deadline too; it goes after them, with the requests that have no deadline."""
    sched, _, _ = make_scheduler(schedule_policy="edf", prefill_max_requests=1)
    clock = Clock()
    sched.clock.source = clock
    now = clock.t
    reqs = [
        add(sched, "missed", 8, now - 1.0, arrival=0.0),
        add(sched, "none", 8, None, arrival=1.0),
        add(sched, "later", 8, now + 9.0, arrival=2.0),
        add(sched, "soon", 8, now + 3.0, arrival=3.0),
        add(sched, "missed_more", 8, now - 5.0, arrival=4.0),
    ]
    order: list[str] = []
    while sched.has_work():
        sched.step()
        order += [r.rid for r in reqs if r.first_scheduled_time is not None and r.rid not in order]
    assert order == ["soon", "later", "missed", "none", "missed_more"]
    drain(sched)


def test_deadline_admission_rejects_unmeetable() -> None:
    sched, _, _ = make_scheduler(pool_tokens=512, schedule_policy="edf", deadline_admission=True,
                                 deadline_prefill_tokens_per_s=100.0)
    clock = Clock()
    sched.clock.source = clock
    now = clock.t
    queued = [add(sched, f"q{i}", 100, now + 5.0) for i in range(3)]  # 1, 2, 3 s of prefill: all meetable
    tight = add(sched, "tight", 50, now + 0.4)  # first in edf order, but 50 tokens take 0.5 s
    ok = add(sched, "ok", 50, now + 0.6)  # 0.5 s <= 0.6 s
    behind = add(sched, "behind", 160, now + 5.0)  # 160 own + 300 queued + 50 (ok): 5.1 s > 5 s
    later = add(sched, "later", 50, now + 6.0)  # 50 + 300 + 50: 4 s <= 6 s
    free = add(sched, "free", 50, None)  # no deadline: never refused
    for r in (tight, behind):
        reason = r.finished_reason
        assert isinstance(reason, FINISH_ABORT) and reason.status_code == 429
        assert reason.code == "deadline_unmeetable" and "deadline" in reason.message
    assert all(r.finished_reason is None for r in (*queued, ok, later, free))
    assert sched.stats.num_deadline_rejected == 2
    assert sched.queues.waiting == [*queued, ok, later, free]
    drain(sched)
    for r in (*queued, ok, later, free):
        assert r.output_ids == expected_tokens(r.origin_input_ids, 2)


def test_deadline_admission_off_serves_late() -> None:
    sched, _, _ = make_scheduler(schedule_policy="edf", deadline_prefill_tokens_per_s=1.0)
    late = add(sched, "late", 50, sched.clock() - 1.0)  # already past: admitted anyway
    assert late.finished_reason is None
    drain(sched)
    assert late.output_ids == expected_tokens(late.origin_input_ids, 2)


def test_prefill_throughput_ema_follows_measurements() -> None:
    sched, _, _ = make_scheduler(pool_tokens=512, schedule_policy="edf", deadline_prefill_tokens_per_s=1.0)
    add(sched, "a", 100, None)
    drain(sched)
    assert sched.deadlines.throughput.tokens_per_s > 1.0  # one 100-token prefill measured (alpha 0.2)


def test_slot_wait_counts_the_running_requests_that_must_finish_first() -> None:
    from types import SimpleNamespace

    from radixserve.sched.deadline import slot_wait

    def running(max_new: int, done: int) -> SimpleNamespace:
        return SimpleNamespace(sampling_params=SimpleNamespace(max_new_tokens=max_new), output_ids=[0] * done)

    batch = [running(10, 5), running(20, 11), running(8, 8)]  # 5, 9 and 0 tokens to go
    assert slot_wait(batch, 4, 1, 0.01) == 0.0  # a slot is free
    assert slot_wait(batch, 4, 2, 0.01) == 0.0  # the one finishing now frees the second
    assert abs(slot_wait(batch, 4, 3, 0.01) - 0.05) < 1e-12
    assert abs(slot_wait(batch, 4, 4, 0.01) - 0.09) < 1e-12
    # past the batch: whole turnovers of it (each as long as its longest), then the rest
    assert abs(slot_wait(batch, 4, 6, 0.01) - (0.09 + 0.05)) < 1e-12
    assert abs(slot_wait(batch, 4, 7, 0.01) - 0.18) < 1e-12
    assert slot_wait(batch, 4, 4, 0.0) == 0.0  # no decode step measured yet


def test_backlog_rate_counts_the_decode_steps_between_prefills() -> None:
    from radixserve.sched.deadline import BACKLOG_WINDOW, PrefillThroughput

    est = PrefillThroughput(1000.0)
    for i in range(BACKLOG_WINDOW):
        extend = i % 4 == 0  # one 400-token prefill (0.1 s) every three decode steps (0.05 s each)
        est.observe(extend, 400 if extend else 8, 0.1 if extend else 0.05, backlogged=True)
    assert 3900.0 < est.tokens_per_s < 4000.0  # the EMA nears the 4,000 tokens/s of prefill steps alone
    assert abs(est.decode_step_s - 0.05) < 1e-9
    assert est.backlog_tokens_per_s is not None and abs(est.backlog_tokens_per_s - 1600.0) < 1e-6  # 400 / 0.25 s
