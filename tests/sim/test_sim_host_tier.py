"""The host tier in the simulator (``--enable-hierarchical-cache``): the engine's own HiCache behind
each simulated worker, its loads timed by the cost model's host link. On a multi-turn workload whose
working set is several times the pool, the tier turns recomputed history into hits, a slower link
makes those hits later, runs stay deterministic, and a fleet's router sees the tier in its events."""

from __future__ import annotations

from typing import Any

from radixserve.config import ServerArgs
from radixserve.router.policy import CacheAware
from radixserve.sim.cost_model import make_cost_model
from radixserve.sim.fleet import Fleet
from radixserve.sim.fleet_config import FleetConfig
from radixserve.sim.fleet_report import summarize_fleet
from radixserve.sim.simulator import run
from radixserve.sim.summary import summarize
from radixserve.sim.workload import WorkloadConfig, generate

CTX = 8192
# 40 conversations of 4 turns, each turn ~1,000 more tokens of history: a working set of ~160k
# tokens against a pool of 24k
WL = WorkloadConfig(workload="multi-turn", num_requests=160, num_turns=4, input_len=1000, turn_len=1000,
                    output_len=32, think_time=20.0, request_rate=2.0, context_len=CTX, seed=5)
ARGS = ServerArgs(max_total_tokens=24000, max_running_requests=16)
TIER = {"enable_hierarchical_cache": True, "hicache_ratio": 8.0}


def _run(args: ServerArgs, **cost: Any) -> dict[str, Any]:
    return summarize(run(args, generate(WL), make_cost_model(**cost), CTX))


def test_the_tier_turns_recomputed_history_into_hits() -> None:
    off = _run(ARGS)
    on = _run(ARGS.replace(**TIER))
    assert on["completed"] == off["completed"] == 160
    tier = on["stats"]["host_tier"]
    assert tier["loads"] > 20 and tier["loaded_tokens"] > 30000
    assert on["cache_hit_rate"] > 2 * off["cache_hit_rate"]
    assert on["ttft_ms"]["p50"] < off["ttft_ms"]["p50"]
    assert "host_tier" not in off["stats"]
    assert _run(ARGS.replace(**TIER)) | {"wall": None} == on | {"wall": None}  # deterministic


def test_a_slower_link_makes_tier_hits_later() -> None:
    """The same run over a 50 GB/s and a 0.5 GB/s host link: loads take ~100x longer."""
    fast = _run(ARGS.replace(**TIER))["stats"]["host_tier"]
    slow = _run(ARGS.replace(**TIER), pcie_gbps=0.5)["stats"]["host_tier"]
    assert slow["loads"] > 0 and slow["mean_load_ms"] > 30 * fast["mean_load_ms"]
    # a Llama-2-7B token is 512 KiB of KV: ~10 ms per 1,000 tokens at 50 GB/s
    per_token_ms = fast["mean_load_ms"] / (fast["loaded_tokens"] / fast["loads"])
    assert 0.005 < per_token_ms < 0.05


def test_a_fleet_routes_with_the_tiers_in_its_events() -> None:
    specs = generate(WL)
    args = ARGS.replace(**TIER)
    fleet = Fleet(args, make_cost_model(), CTX, FleetConfig(num_workers=4, policy="cache_aware", cache_events=True))
    trace = fleet.run(specs)
    for eng in fleet.engines:
        eng.sched.kv.check_invariant()
    res = summarize_fleet(trace, args)
    assert res["completed"] == 160 and res["stats"]["host_tier"]["loads"] > 0
    # the router's policy keeps the tiers' blocks in a tree of their own (events with medium CPU)
    policy = fleet.replicas[0].policy
    assert isinstance(policy, CacheAware) and policy.lower.tenants()
