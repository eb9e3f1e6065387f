"""TPOT deadlines (sched/deadline.py): the decode step model, the batch cap, prefill pacing and
the refusal at arrival."""

from __future__ import annotations

import pytest

from radixserve.sched.core import SchedulerCore
from radixserve.sched.deadline import DecodeStepModel
from radixserve.sched.finish import FINISH_ABORT
from radixserve.sched.req import Req
from radixserve.sched.sampling_params import SamplingParams
from radixserve.sched.schedule_batch import ForwardMode, ScheduleBatch
from tests.fakes import drain, expected_tokens, make_scheduler
from tests.sched.policy_helpers import prompt


def _add(sched: SchedulerCore, rid: str, tpot_s: float | None, max_new: int = 6) -> Req:
    req = Req(rid, prompt(hash(rid) % 10000, 8), SamplingParams(max_new_tokens=max_new))
    if tpot_s is not None:
        req.tpot_slo = tpot_s  # as the server and the simulator set it
    sched.add_request(req)
    return req


def _model(points: list[tuple[int, float]]) -> DecodeStepModel:
    m = DecodeStepModel()
    for bs, t in points:
        m.observe(bs, t)
    return m


def test_decode_step_model_fits_a_line() -> None:
    m = _model([(1, 0.011), (2, 0.012), (4, 0.014), (8, 0.018)])
    a, c = m.coefficients()  # type: ignore[misc]
    assert a == pytest.approx(0.010) and c == pytest.approx(0.001)
    assert m.max_batch(0.020) == 10
    assert m.max_batch(0.0105) == 0  # not even one request
    assert _model([(4, 0.02), (4, 0.02)]).max_batch(0.05) is None  # one batch size: no slope to cap by
    assert _model([(4, 0.02)]).max_batch(0.01) == 0  # ... but a step already too slow is known
    assert DecodeStepModel().max_batch(0.01) is None


def test_running_batch_is_capped_for_the_tightest_tpot() -> None:
    sched, _, _ = make_scheduler(pool_tokens=1024, tpot_headroom=1.0)
    for bs, t in [(1, 0.011), (2, 0.012), (4, 0.014)]:  # a + c * bs with a = 10 ms, c = 1 ms
        sched.deadlines.decode_model.observe(bs, t)
    sched.deadlines.decode_model.observe = lambda bs, t: None  # type: ignore[method-assign]  # keep the model
    reqs = [_add(sched, f"t{i}", 0.013) for i in range(6)]  # 13 ms: at most 3 running
    most = 0
    while sched.has_work():
        sched.step()
        most = max(most, len(sched.queues.running.reqs))
    assert most == 3
    for r in reqs:
        assert r.output_ids == expected_tokens(r.origin_input_ids, 6)
    sched.kv.check_invariant()
    # without a TPOT deadline nothing caps the batch
    free = [_add(sched, f"f{i}", None) for i in range(6)]
    sched.step()
    sched.step()
    assert len(sched.queues.running.reqs) == 6
    drain(sched)
    assert all(r.finished() for r in free)


def test_prefills_are_paced_by_the_debt_they_leave() -> None:
    sched, _, _ = make_scheduler(pool_tokens=1024, tpot_headroom=1.0)
    d = sched.deadlines
    assert d.may_prefill(0.05)
    log = sched.stats.step_log
    log.append(("EXTEND", 4, 400, 0.10))  # a 100 ms prefill stalls requests whose TPOT is 50 ms
    d.observe(ScheduleBatch([], ForwardMode.EXTEND))
    assert d.prefill_debt_s == pytest.approx(0.10)
    paid = []
    while not d.may_prefill(0.05):
        log.append(("DECODE", 4, 4, 0.02))  # each 20 ms decode step pays back 30 ms
        d.observe(ScheduleBatch([], ForwardMode.DECODE))
        paid.append(d.prefill_debt_s)
    assert paid == pytest.approx([0.07, 0.04, 0.01, 0.0])
    assert d.may_prefill(None)  # nothing running with a TPOT deadline: no pacing


def test_unmeetable_tpot_is_refused_at_arrival() -> None:
    sched, _, _ = make_scheduler(pool_tokens=1024, deadline_admission=True, tpot_headroom=1.0)
    sched.deadlines.decode_model.observe(1, 0.05)
    refused = _add(sched, "fast", 0.02)
    ok = _add(sched, "slow", 0.08)
    outs = drain(sched)
    fin = {o.rid: o.finished_reason for o in outs if o.finished_reason is not None}
    assert isinstance(fin["fast"], FINISH_ABORT) and fin["fast"].code == "tpot_unmeetable"
    assert fin["fast"].status_code == 429 and refused.output_ids == []
    assert ok.output_ids == expected_tokens(ok.origin_input_ids, 6)
