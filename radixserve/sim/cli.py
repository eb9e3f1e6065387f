"""``radixserve simulate``: the entry point (options in ``radixserve.sim.options``)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time
from collections.abc import Iterator
from typing import Any

from radixserve.config import ServerArgs
from radixserve.results import write_result
from radixserve.router.policy import PolicyConfig
from radixserve.sched.core import calm_garbage_collector
from radixserve.sim.cost_model import DraftModelSim, H100Llama2CostModel, make_cost_model
from radixserve.sim.fleet import run_fleet
from radixserve.sim.fleet_config import FleetConfig
from radixserve.sim.fleet_report import fleet_item, fleet_table, fleet_text, summarize_fleet
from radixserve.sim.options import (
    _SKIP_GROUPS,
    GPU_MEM_BYTES,
    GPU_MEM_FRACTION,
    LINEAR_DEFAULT_POOL,
    WEIGHT_BYTES,
    args_for,
)
from radixserve.sim.report import compare_table, plot, summary_text
from radixserve.sim.simulator import SimTrace, run
from radixserve.sim.summary import summarize
from radixserve.sim.workload import RequestSpec, WorkloadConfig, generate, read_trace, write_trace


def workload_config(ns: argparse.Namespace) -> WorkloadConfig:
    return WorkloadConfig(
        num_requests=ns.num_requests, workload=ns.workload, request_rate=ns.request_rate, arrival=ns.arrival,
        burstiness=ns.burstiness, input_len=ns.input_len, output_len=ns.output_len, len_dist=ns.len_dist,
        range_ratio=ns.range_ratio, num_prefix_groups=ns.num_prefix_groups, prefix_len=ns.prefix_len,
        num_turns=ns.num_turns, turn_len=ns.turn_len, think_time=ns.think_time, priority_classes=ns.priority_classes,
        tenants=ns.tenants, ttft_slo_ms=ns.ttft_slo_ms, ttft_slo_classes=ns.ttft_slo_classes,
        tpot_slo_ms=ns.tpot_slo_ms,
        context_len=ns.context_length, seed=ns.seed,
    )


def server_args(ns: argparse.Namespace, cost: Any) -> ServerArgs:
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(ServerArgs):
        v = getattr(ns, f.name, None)
        if v is not None and f.metadata.get("group") not in _SKIP_GROUPS:
            kwargs[f.name] = v
    if kwargs.get("max_total_tokens") is None:
        if isinstance(cost, H100Llama2CostModel):
            kwargs["max_total_tokens"] = int((GPU_MEM_BYTES * GPU_MEM_FRACTION - WEIGHT_BYTES) // cost.kv_bytes_per_token())
        else:
            kwargs["max_total_tokens"] = LINEAR_DEFAULT_POOL
    kwargs["random_seed"] = ns.seed
    kwargs["context_length"] = ns.context_length
    return ServerArgs(**kwargs)


@contextlib.contextmanager
def profiled(path: str | None) -> Iterator[None]:
    """``--profile``: cProfile the block, write the stats to ``path``, print the top 25 by own time."""
    if not path:
        yield
        return
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        prof.dump_stats(path)
        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(25)


def main(ns: argparse.Namespace) -> int:
    if not 0.0 <= ns.draft_acceptance <= 1.0 or ns.draft_cost < 0:
        raise SystemExit("--draft-acceptance must be in [0, 1] and --draft-cost at least 0")
    cost = make_cost_model(ns.cost_model, num_kv_heads=ns.kv_heads, step_overhead_ms=ns.step_overhead_ms,
                           ms_per_step=ns.ms_per_step, ms_per_token=ns.ms_per_token,
                           ms_per_context_token=ns.ms_per_context_token,
                           draft=DraftModelSim(ns.draft_acceptance, ns.draft_cost), pcie_gbps=ns.pcie_gbps,
                           ms_per_loaded_token=ns.ms_per_loaded_token,
                           kv_bytes_per_elem=1 if ns.kv_cache_dtype.startswith(("fp8", "int8")) else 2)
    base = server_args(ns, cost)
    t0 = time.perf_counter()
    specs = read_trace(ns.trace, ns.context_length) if ns.trace else generate(workload_config(ns))
    if ns.save_trace:
        write_trace(specs, ns.save_trace)
    print(f"[simulate] {len(specs)} requests ({'trace ' + ns.trace if ns.trace else ns.workload}), cost model "
          f"{cost.name}, KV pool {base.max_total_tokens} tokens, generated in {time.perf_counter() - t0:.1f} s",
          file=sys.stderr)
    runs = [args_for(base, item.strip()) for item in ns.compare.split(",")] if ns.compare else [("", base)]
    if is_fleet(ns):
        return fleet_main(ns, runs, specs, cost)
    calm_garbage_collector()
    traces: list[SimTrace] = []
    results: list[dict[str, Any]] = []
    with profiled(ns.profile):
        for label, args in runs:
            label = label or (args.scheduler if args.scheduler == "unified" else args.schedule_policy)
            trace = run(args, specs, cost, ns.context_length, label=label, progress=not ns.no_progress,
                        skip_req_to_token_writes=ns.skip_req_to_token_writes, max_steps=ns.max_steps,
                        stream=ns.stream_output, charge_scheduler_time=ns.charge_scheduler_time)
            traces.append(trace)
            results.append(summarize(trace, args))
    for res in results:
        print(summary_text(res))
        print()
    if len(results) > 1:
        print(compare_table(results))
    if ns.output:
        write_result(ns.output, {"results": results})
    if ns.plot:
        plot(results, traces, ns.plot)
        print(f"[simulate] plot written to {ns.plot}", file=sys.stderr)
    return 0


# --- the fleet (--num-workers, --router-policy, --dp-size, --concurrency) ----------------------------
def is_fleet(ns: argparse.Namespace) -> bool:
    return bool(ns.router_policy or ns.num_workers > 1 or ns.dp_size > 1 or ns.dp_aware or ns.router_cache_events
                or ns.concurrency or ns.router_max_concurrent_requests >= 0 or ns.router_replicas > 1)


def fleet_config(ns: argparse.Namespace) -> FleetConfig:
    pc = PolicyConfig(cache_threshold=ns.cache_threshold, balance_abs_threshold=ns.balance_abs_threshold,
                      balance_rel_threshold=ns.balance_rel_threshold, balance_affinity=ns.balance_affinity,
                      seed=ns.seed)
    return FleetConfig(num_workers=ns.num_workers, dp_size=ns.dp_size, dp_aware=ns.dp_aware, policy_config=pc,
                       match=ns.router_match, cache_events=ns.router_cache_events,
                       concurrency=ns.concurrency, router_max_concurrent=ns.router_max_concurrent_requests,
                       router_queue_size=ns.router_queue_size, router_priority=ns.router_priority,
                       router_tenant_fairness=ns.router_tenant_fairness, router_replicas=ns.router_replicas)


def fleet_main(ns: argparse.Namespace, runs: list[tuple[str, ServerArgs]], specs: list[RequestSpec],
               cost: Any) -> int:
    if ns.max_steps is not None:
        raise SystemExit("radixserve simulate: --max-steps is for one engine; the fleet always runs to the end")
    base = fleet_config(ns)
    items = [fleet_item(base, item.strip()) for item in (ns.router_policy or "cache_aware").split(",")]
    engines = base.num_workers * base.dp_size
    # NOTE: a ReqToTokenPool's table is 256 x context int32s: 4 MiB an engine adds up in a large fleet
    skip = ns.skip_req_to_token_writes or engines > 64
    calm_garbage_collector()
    traces: list[SimTrace] = []
    results: list[dict[str, Any]] = []
    with profiled(ns.profile):
        for sched_label, args in runs:
            for router_label, cfg in items:
                label = "/".join(x for x in (sched_label, router_label) if x)
                trace = run_fleet(args, specs, cost, ns.context_length, cfg, label=label,
                                  progress=not ns.no_progress, skip_req_to_token_writes=skip, stream=ns.stream_output)
                res = summarize_fleet(trace, args)
                traces.append(SimTrace(label, records=[r.record for r in trace.records]))
                results.append(res)
                print(fleet_text(res))
                print()
    if len(results) > 1:
        print(fleet_table(results))
    if ns.output:
        write_result(ns.output, {"results": results})
    if ns.plot:
        plot(results, traces, ns.plot)
        print(f"[simulate] plot written to {ns.plot}", file=sys.stderr)
    return 0
