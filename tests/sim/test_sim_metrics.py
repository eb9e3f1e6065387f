"""Result figures: Jain index, goodput, victim counts, mixed TTFT deadlines."""

from __future__ import annotations

import math
from typing import Any

import pytest

from radixserve.config import ServerArgs
from radixserve.sim.cost_model import make_cost_model
from radixserve.sim.metrics import goodput, jain_index, tenant_fairness, victim_counts
from radixserve.sim.simulator import ReqRecord, run
from radixserve.sim.summary import summarize
from radixserve.sim.workload import WorkloadConfig, generate

CTX = 2048


def _rec(**kw: Any) -> ReqRecord:
    d: dict[str, Any] = {"priority": None, "tenant": None, "prompt_len": 10, "output_len": 5, "cached_tokens": 0,
                         "ttft": 0.1, "e2e": 0.5, "tpot": 0.1, "queue": 0.05, "retractions": 0, "preemptions": 0,
                         "aborted": False, "deadline": None, "arrival": 0.0}
    d.update(kw)
    return ReqRecord(**d)


def test_jain_index() -> None:
    assert jain_index([3.0, 3.0, 3.0]) == pytest.approx(1.0)
    assert jain_index([1.0, 0.0]) == pytest.approx(0.5)
    assert jain_index([10.0, 1.0]) == pytest.approx(121 / 202)
    assert jain_index([]) is None and jain_index([0.0, 0.0]) is None


def test_tenant_fairness_counts_service_up_to_the_last_arrival_and_divides_by_weight() -> None:
    recs = [
        # a: done before the window ends: 10 prompt + 2 x 5 output = 20 units
        _rec(tenant="a", arrival=0.0, ttft=0.1, e2e=0.5),
        # b: first token at 1.0, finishes at 3.0 with 5 tokens; at 2.0 it has 1 + 4 * 0.5 = 3 -> 10 + 6 = 16
        _rec(tenant="b", arrival=0.0, ttft=1.0, e2e=3.0),
        # b: arrives last (2.0), first token after the window: nothing counted
        _rec(tenant="b", arrival=2.0, ttft=0.5, e2e=1.0),
    ]
    tf = tenant_fairness(recs)
    assert tf is not None and tf["window_end_s"] == 2.0
    assert tf["share"] == {"a": round(20 / 36, 4), "b": round(16 / 36, 4)}
    assert tf["jain"] == round(36**2 / (2 * (20**2 + 16**2)), 4)
    weighted = tenant_fairness(recs, ServerArgs(tenant_weights="a=2", vtc_output_weight=1.0))
    assert weighted is not None and weighted["share"]["a"] == round(7.5 / 20.5, 4)  # a: 15 / 2, b: 10 + 3
    assert tenant_fairness([_rec(tenant="a")]) is None


def test_goodput_counts_refused_requests_as_missed() -> None:
    recs = [_rec(deadline=0.2, ttft=0.1), _rec(deadline=0.2, ttft=0.3),
            _rec(deadline=0.2, ttft=math.nan, aborted=True), _rec(deadline=None)]
    assert goodput(recs, 2.0) == {"met": 1, "req_s": 0.5, "fraction": round(1 / 3, 4)}
    assert goodput([_rec()], 1.0) is None


def test_victim_counts_add_preemptions_and_retractions() -> None:
    v = victim_counts([_rec(retractions=2, preemptions=1), _rec(), _rec(preemptions=1)])
    assert v == {"per_request": round(4 / 3, 6), "max_per_request": 3, "requests_hit": 2}


def test_ttft_slo_classes_mix_deadlines_and_summarize_reports_goodput_and_fairness() -> None:
    cfg = WorkloadConfig(num_requests=80, request_rate=40.0, input_len=64, output_len=16, context_len=CTX,
                         ttft_slo_classes="100:0.5,2000:0.5", tenants="a:10,b:1")
    specs = generate(cfg)
    assert {s.deadline_ms for s in specs} == {100.0, 2000.0}
    assert generate(WorkloadConfig(num_requests=80, request_rate=40.0, input_len=64, output_len=16,
                                   context_len=CTX)) != specs
    res = summarize(run(ServerArgs(max_total_tokens=20000, max_running_requests=32), specs, make_cost_model(), CTX))
    assert 0 < res["goodput"]["fraction"] <= 1 and res["goodput"]["met"] <= 80
    assert 0.5 <= res["tenant_fairness"]["jain"] <= 1
    assert res["victims"]["max_per_request"] == 0
    with pytest.raises(ValueError):
        generate(WorkloadConfig(num_requests=5, ttft_slo_ms=100, ttft_slo_classes="100:1"))
    mt = generate(WorkloadConfig(num_requests=40, workload="multi-turn", ttft_slo_classes="100:0.5,2000:0.5",
                                 context_len=CTX))
    per_conv: dict[Any, set[Any]] = {}
    for s in mt:
        per_conv.setdefault(s.conversation, set()).add(s.deadline_ms)
    assert all(len(v) == 1 for v in per_conv.values())  # a conversation keeps its deadline class


def test_compare_overrides_of_optional_float_fields_are_floats() -> None:
    from radixserve.sim.options import args_for

    base = ServerArgs(max_total_tokens=1000)
    assert args_for(base, "priority:priority_aging_horizon=10")[1].priority_aging_horizon == 10.0
    assert args_for(base, "fcfs:queue_timeout=2.5")[1].queue_timeout == 2.5
    assert args_for(base, "fcfs:priority_aging_horizon=none")[1].priority_aging_horizon is None
