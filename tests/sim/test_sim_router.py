"""The simulated fleet: router policies in front of several simulated engines on one virtual timeline."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from radixserve.cli import main as cli_main
from radixserve.config import ServerArgs
from radixserve.router.policy import PolicyConfig
from radixserve.sim.cost_model import make_cost_model
from radixserve.sim.fleet import Fleet, run_fleet
from radixserve.sim.fleet_config import FleetConfig, chars_key
from radixserve.sim.fleet_report import fleet_item, summarize_fleet
from radixserve.sim.fleet_state import FleetTrace
from radixserve.sim.simulator import run
from radixserve.sim.workload import RequestSpec, WorkloadConfig, generate

CTX = 2048
ARGS = ServerArgs(max_total_tokens=20000, max_running_requests=32)


def _specs(**wl: Any) -> list[RequestSpec]:
    cfg = WorkloadConfig(**{"num_requests": 40, "request_rate": 40.0, "input_len": 64, "output_len": 16,
                            "context_len": CTX, **wl})  # type: ignore[arg-type]
    return generate(cfg)


def _fleet(specs: list[RequestSpec], args: ServerArgs = ARGS, **cfg: Any) -> tuple[Fleet, FleetTrace]:
    fleet = Fleet(args, make_cost_model(), CTX, FleetConfig(**cfg))
    trace = fleet.run(specs)
    assert all(t.load == 0 for t in fleet.targets) and not fleet.routed  # nothing leaked
    for eng in fleet.engines:
        eng.sched.kv.check_invariant()
    return fleet, trace


def _per_worker(trace: FleetTrace) -> Counter[int]:
    return Counter(r.worker for r in trace.records)


def test_round_robin_spreads_evenly() -> None:
    _, trace = _fleet(_specs(num_requests=8), num_workers=4, policy="round_robin")
    assert _per_worker(trace) == {0: 2, 1: 2, 2: 2, 3: 2}
    assert {r.branch for r in trace.records} == {"round_robin"}
    assert all(r.predicted is None for r in trace.records)


def test_cache_aware_keeps_each_prefix_group_on_one_worker() -> None:
    specs = _specs(workload="shared-prefix", num_prefix_groups=2, prefix_len=256, input_len=32, num_requests=40)
    group = {s.rid: s.prefix_group for s in specs}
    _, ca = _fleet(specs, num_workers=2, policy="cache_aware")
    where: dict[int | None, set[int]] = {}
    for r in ca.records:
        where.setdefault(group[r.rid], set()).add(r.worker)
    assert sorted(map(len, where.values())) == [1, 1] and where[0] != where[1]
    _, rr = _fleet(specs, num_workers=2, policy="round_robin")
    hit_ca, hit_rr = summarize_fleet(ca)["cache_hit_rate"], summarize_fleet(rr)["cache_hit_rate"]
    assert hit_ca > hit_rr
    res = summarize_fleet(ca)
    assert res["router"]["branches"] == {"cache_hit": 38, "cache_miss": 2}
    assert res["router"]["imbalance"] == pytest.approx(2 * max(_per_worker(ca).values()) / 40)
    assert 0 <= res["router"]["hit_rate_error"] < 0.2


def test_dp_aware_targets_are_ranks_and_plain_dp_round_robins_over_them() -> None:
    specs = _specs(num_requests=12)
    aware, trace = _fleet(specs, num_workers=2, dp_size=2, dp_aware=True, policy="round_robin")
    assert [t.key for t in aware.targets] == ["w0#dp0", "w0#dp1", "w1#dp0", "w1#dp1"]
    assert Counter((r.worker, r.rank) for r in trace.records) == {(0, 0): 3, (0, 1): 3, (1, 0): 3, (1, 1): 3}
    plain, trace = _fleet(specs, num_workers=2, dp_size=2, policy="cache_aware")
    assert [t.key for t in plain.targets] == ["w0", "w1"] and len(plain.engines) == 4
    per_rank = Counter((r.worker, r.rank) for r in trace.records)
    for w in (0, 1):  # the worker's DP controller alternates its ranks
        assert abs(per_rank[(w, 0)] - per_rank[(w, 1)]) <= 1
    res = summarize_fleet(trace)
    assert res["fleet"]["dp_size"] == 2 and "rank_imbalance" in res["router"]
    assert [sum(w["per_rank"]) for w in res["workers"]] == [w["requests"] for w in res["workers"]]


def test_one_engine_fleet_equals_the_single_engine_loop() -> None:
    specs = _specs(workload="multi-turn", num_turns=3, num_requests=45, request_rate=20.0, prefix_len=128,
                   num_prefix_groups=2)
    single = run(ARGS, specs, make_cost_model(), CTX)
    _, trace = _fleet(specs, num_workers=1, policy="cache_aware")
    assert [r.record for r in trace.records] == single.records
    assert trace.duration == single.duration


def test_cli_one_worker_without_router_is_the_single_engine_path(tmp_path: Path) -> None:
    common = ["simulate", "--num-requests", "30", "--request-rate", "50", "--input-len", "32", "--output-len", "8",
              "--no-progress", "--max-total-tokens", "5000", "--workload", "multi-turn", "--num-turns", "3"]
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert cli_main([*common, "--output", str(a)]) == 0
    assert cli_main([*common, "--num-workers", "1", "--output", str(b)]) == 0
    ra, rb = (json.loads(p.read_text())["results"] for p in (a, b))
    for x in (*ra, *rb):
        x.pop("wall")
    assert ra == rb and "router" not in ra[0]


def test_closed_loop_keeps_at_most_concurrency_requests_in_flight() -> None:
    specs = _specs(workload="multi-turn", num_turns=3, num_requests=30, prefix_len=64)
    _, trace = _fleet(specs, num_workers=2, policy="cache_aware", concurrency=3)
    recs = [r.record for r in trace.records]
    assert len(recs) == 30
    edges = sorted([(r.arrival, 1) for r in recs] + [(r.arrival + r.e2e, -1) for r in recs],
                   key=lambda e: (e[0], e[1]))
    live = peak = 0
    for _, d in edges:
        live += d
        peak = max(peak, live)
    assert peak == 3
    assert min(r.arrival for r in recs) == 0.0


def test_cache_events_make_the_router_predict_what_the_engines_hold() -> None:
    """Under KV pressure the engines evict; the approximate tree does not know, the event-driven one does."""
    specs = _specs(workload="multi-turn", num_turns=3, num_requests=90, prefix_len=300, num_prefix_groups=3,
                   input_len=200, output_len=32, request_rate=30.0)
    args = ServerArgs(max_total_tokens=3000, max_running_requests=16)
    errs = {}
    for events in (False, True):
        _, trace = _fleet(specs, args, num_workers=2, policy="cache_aware", cache_events=events)
        errs[events] = summarize_fleet(trace)["router"]["hit_rate_error"]
    assert errs[True] < errs[False] / 2


def test_chars_key_is_a_text_stand_in() -> None:
    a, b = chars_key([500, 501, 502]), chars_key([500, 501, 999])
    assert a == chars_key([500, 501, 502]) and a != b and a.isalpha()
    assert 9 <= len(a) <= 18
    assert a.startswith(chars_key([500, 501]))
    specs = _specs(workload="shared-prefix", num_prefix_groups=2, prefix_len=256, input_len=32, num_requests=20)
    _, trace = _fleet(specs, num_workers=2, policy="cache_aware", match="chars")
    assert all(r.predicted is not None for r in trace.records)


def test_balance_affinity_and_items() -> None:
    base = FleetConfig(num_workers=4, policy_config=PolicyConfig(seed=3))
    label, cfg = fleet_item(base, "cache_aware:balance_affinity=1:dp_aware=true:match=chars:concurrency=none")
    assert label.startswith("cache_aware") and cfg.policy_config.balance_affinity and cfg.dp_aware
    assert cfg.match == "chars" and cfg.concurrency is None and cfg.policy_config.seed == 3 and cfg.num_workers == 4
    assert fleet_item(base, "power_of_two")[1].policy == "power_of_two"
    assert fleet_item(base, "deadline_aware")[1].policy == "deadline_aware"
    for bad in ("nope", "cache_aware:nope=1", "cache_aware:balance_affinity"):
        with pytest.raises(ValueError):
            fleet_item(base, bad)
    # a long shared prompt and a low balance threshold: the balance branch fires, affinity keeps locality
    specs = _specs(workload="shared-prefix", num_prefix_groups=1, prefix_len=512, input_len=16, num_requests=60,
                   request_rate=400.0, output_len=64)
    pc = PolicyConfig(balance_abs_threshold=2, balance_affinity=True)
    trace = run_fleet(ARGS, specs, make_cost_model(), CTX, FleetConfig(num_workers=4, policy_config=pc))
    branches = Counter(r.branch for r in trace.records)
    assert branches["balance_affinity"] > 0 and len(_per_worker(trace)) == 4


def test_multi_turn_system_prompt() -> None:
    plain = _specs(workload="multi-turn", num_turns=3)
    assert all(s.prefix_group is None and s.prefix_len == 0 for s in plain)
    shared = _specs(workload="multi-turn", num_turns=3, prefix_len=100, num_prefix_groups=2)
    assert {s.prefix_group for s in shared} == {0, 1}
    heads = {s.prefix_group: s.prompt_ids()[:100] for s in shared}
    for s in shared:
        assert s.prompt_ids()[:100] == heads[s.prefix_group] and s.prompt_len > 100
    # the same conversations and lengths, each prompt 100 tokens longer
    assert [(s.rid, s.output_len) for s in plain] == [(s.rid, s.output_len) for s in shared]
    assert [s.prompt_len + 100 for s in plain] == [s.prompt_len for s in shared]


def test_cli_fleet_compares_policies(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "f.json"
    rc = cli_main(["simulate", "--num-requests", "40", "--request-rate", "50", "--input-len", "32", "--output-len", "8",
                   "--no-progress", "--max-total-tokens", "5000", "--workload", "multi-turn", "--num-turns", "3",
                   "--prefix-len", "64", "--num-workers", "3", "--router-policy",
                   "cache_aware,round_robin,random,power_of_two,cache_aware:balance_affinity=1",
                   "--router-cache-events", "--output", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "| cache_aware:balance_affinity=1" in text and "| power_of_two" in text and "hit err" in text
    results = json.loads(out.read_text())["results"]
    assert [r["fleet"]["policy"] for r in results] == ["cache_aware", "round_robin", "random", "power_of_two",
                                                       "cache_aware"]
    assert all(len(r["workers"]) == 3 and r["completed"] == 40 for r in results)
    assert results[0]["fleet"]["cache_events_received"] > 0 and results[1]["fleet"]["cache_events_received"] == 0
    assert "p95" in results[0]["ttft_ms"] and "p95" in results[0]["tpot_ms"]


def test_deadline_aware_refuses_at_the_router_what_no_worker_can_meet() -> None:
    specs = _specs(num_requests=60, request_rate=400.0, input_len=512, ttft_slo_classes="30:0.5,100000:0.5")
    fleet, trace = _fleet(specs, num_workers=2, policy="deadline_aware")
    refused = [r for r in trace.records if r.branch == "deadline_refused"]
    assert len(trace.records) == 60 and refused  # every request accounted for, some refused up front
    assert all(r.worker == -1 and r.record.aborted and r.record.deadline is not None
               and r.record.deadline < 1.0 for r in refused)  # only tight ones: the loose always fit
    assert {r.branch for r in trace.records} <= {"deadline_fastest", "deadline_hit", "deadline_refused"}
    res = summarize_fleet(trace)
    assert sum(w["requests"] for w in res["workers"]) == 60 - len(refused)


def test_session_affinity_keeps_each_conversation_on_one_worker() -> None:
    """round_robin with the conversation as the routing key: every conversation's turns on one worker
    (its earlier turns cached there), where plain round robin scatters them; conversations spread."""
    specs = _specs(workload="multi-turn", num_turns=4, num_requests=48, request_rate=8.0)
    conv = {s.rid: s.conversation for s in specs}
    runs = {}
    for affinity in (False, True):
        _, trace = _fleet(specs, num_workers=4, policy="round_robin", session_affinity=affinity)
        where: dict[int | None, set[int]] = {}
        for r in trace.records:
            where.setdefault(conv[r.rid], set()).add(r.worker)
        runs[affinity] = (where, summarize_fleet(trace)["cache_hit_rate"])
    where, hit = runs[True]
    assert all(len(w) == 1 for w in where.values()) and len(set().union(*where.values())) == 4
    assert any(len(w) > 1 for w in runs[False][0].values())
    assert hit > runs[False][1]
    _, item = fleet_item(FleetConfig(), "round_robin:session_affinity=1")
    assert item.session_affinity


def test_router_replicas_agree_when_misses_do_not_hang_on_their_own_loads() -> None:
    """Two router replicas fed the same cache events, requests reaching them in turn: misses by load
    (each replica's own in-flight counts) split their decisions; consistent misses keep them alike."""
    specs = _specs(workload="multi-turn", num_turns=4, num_requests=160, request_rate=80.0)
    agreement = {}
    for consistent in (False, True):
        _, trace = _fleet(specs, num_workers=4, cache_events=True, router_replicas=2,
                          policy_config=PolicyConfig(consistent_misses=consistent))
        assert len(trace.records) == 160
        agreement[consistent] = trace.replica_agreement
        assert summarize_fleet(trace)["router"]["replica_agreement"] == trace.replica_agreement
    assert agreement[True] is not None and agreement[False] is not None
    assert agreement[True] >= 0.95 > agreement[False], agreement
    _, single = _fleet(specs, num_workers=4, cache_events=True)
    assert single.replica_agreement is None
    fleet, trace = _fleet(specs[:40], num_workers=2, policy="deadline_aware", router_replicas=2)
    assert trace.replica_agreement is not None  # every replica reads the workers' reports
    assert all(t.prefill_tokens_per_s > 0 for rep in fleet.replicas for t in rep.targets)
    with pytest.raises(ValueError, match="session_affinity"):
        FleetConfig(router_replicas=2, session_affinity=True)
