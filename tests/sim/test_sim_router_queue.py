"""The simulated router's own queue (the HTTP router's AdmissionQueue on the virtual clock):
priority order, VTC order over tenants fleet-wide, refusal when full, nothing leaked."""

from __future__ import annotations

from typing import Any

from radixserve.config import ServerArgs
from radixserve.router.admission import AdmissionQueue, TenantCounters
from radixserve.sim.cost_model import make_cost_model
from radixserve.sim.fleet import Fleet
from radixserve.sim.fleet_config import FleetConfig
from radixserve.sim.fleet_report import fleet_item, summarize_fleet
from radixserve.sim.fleet_state import FleetTrace
from radixserve.sim.workload import RequestSpec

CTX = 2048
ARGS = ServerArgs(max_total_tokens=20000, max_running_requests=32)


def _spec(i: int, t: float, priority: int | None = None, tenant: str | None = None) -> RequestSpec:
    return RequestSpec(rid=f"r{i}", arrival_time=t, prompt_len=40, output_len=8, priority=priority, tenant=tenant,
                       stream=1000 + i)


def _run(specs: list[RequestSpec], **cfg: Any) -> tuple[Fleet, FleetTrace]:
    fleet = Fleet(ARGS, make_cost_model(), CTX, FleetConfig(num_workers=2, policy="round_robin", **cfg))
    trace = fleet.run(specs)  # ends with the fleet's own drain check: loads, queue and memory
    assert fleet.queue.waiting == 0 and fleet.queue.in_flight == 0
    return fleet, trace


def _served_order(trace: FleetTrace) -> list[str]:
    """Requests by the time their first token came (one in flight at a time: the dispatch order)."""
    recs = [r for r in trace.records if r.worker >= 0]
    return [r.rid for r in sorted(recs, key=lambda r: r.record.arrival + r.record.ttft)]


def test_priority_at_the_router_queue() -> None:
    # r0 takes the only slot; r1..r3 (low) and r4 (high) wait at the router
    specs = [_spec(0, 0.0, 0), _spec(1, 0.001, 0), _spec(2, 0.002, 0), _spec(3, 0.003, 0), _spec(4, 0.004, 10)]
    _, fifo = _run(specs, router_max_concurrent=1)
    assert _served_order(fifo) == ["r0", "r1", "r2", "r3", "r4"]
    _, prio = _run(specs, router_max_concurrent=1, router_priority=True)
    assert _served_order(prio) == ["r0", "r4", "r1", "r2", "r3"]


def test_tenant_fairness_at_the_router_queue() -> None:
    # tenant a sends 6 at once, then b sends 2: with VTC the router interleaves b as soon as it waits
    specs = [_spec(i, 0.001 * i, tenant="a") for i in range(6)] + [_spec(6, 0.01, tenant="b"),
                                                                      _spec(7, 0.011, tenant="b")]
    _, fifo = _run(specs, router_max_concurrent=1)
    assert _served_order(fifo) == [f"r{i}" for i in range(8)]
    _, vtc = _run(specs, router_max_concurrent=1, router_tenant_fairness=True)
    order = _served_order(vtc)
    # b arrives lifted to a's smallest waiting counter and goes first at the next release, then
    # alternates with a while both wait
    assert order[:2] == ["r0", "r1"] and order.index("r6") < order.index("r3") and order.index("r7") < order.index("r5")


def test_a_full_router_queue_refuses() -> None:
    specs = [_spec(i, 0.0001 * i) for i in range(6)]
    _, trace = _run(specs, router_max_concurrent=1, router_queue_size=2)
    branches = [r.branch for r in sorted(trace.records, key=lambda r: r.rid)]
    assert branches.count("router_queue_full") == 3  # one in flight, two waiting, three refused
    res = summarize_fleet(trace)
    assert res["aborted"] == 3 and res["fleet"]["router_queue"]["max_concurrent"] == 1


def test_router_queue_options_from_the_command_line_items() -> None:
    _, cfg = fleet_item(FleetConfig(), "round_robin:router_max_concurrent=8:router_tenant_fairness=1")
    assert cfg.router_max_concurrent == 8 and cfg.router_tenant_fairness and not cfg.router_priority


def test_admission_queue_core() -> None:
    q: AdmissionQueue[str] = AdmissionQueue(limit=1, queue_size=2, tenants=TenantCounters())
    assert q.admit("x", tenant="a", cost=10) == "now"
    assert q.admit("y", tenant="a", cost=10) == "queued"
    assert q.admit("z", tenant="b", cost=10) == "queued"  # b lifted to a's waiting counter (10)
    assert q.admit("w") == "rejected" and q.rejected == 1
    assert q.release() == "y"  # equal counters: first come
    assert q.release() == "z"
    assert q.release() is None and q.in_flight == 0
