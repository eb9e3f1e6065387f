"""``radixserve simulate``: the entry point (options in ``radixserve.sim.options``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any

from radixserve.config import ServerArgs
from radixserve.sched.scheduler import calm_garbage_collector
from radixserve.sim.cost_model import H100Llama2CostModel, make_cost_model
from radixserve.sim.options import (
    _SKIP_GROUPS,
    GPU_MEM_BYTES,
    GPU_MEM_FRACTION,
    LINEAR_DEFAULT_POOL,
    WEIGHT_BYTES,
)
from radixserve.sim.report import compare_table, plot, summary_text
from radixserve.sim.simulator import SimTrace, args_for, run, summarize
from radixserve.sim.workload import WorkloadConfig, generate, read_trace, write_trace


def workload_config(ns: argparse.Namespace) -> WorkloadConfig:
    return WorkloadConfig(
        num_requests=ns.num_requests, workload=ns.workload, request_rate=ns.request_rate, arrival=ns.arrival,
        burstiness=ns.burstiness, input_len=ns.input_len, output_len=ns.output_len, len_dist=ns.len_dist,
        range_ratio=ns.range_ratio, num_prefix_groups=ns.num_prefix_groups, prefix_len=ns.prefix_len,
        num_turns=ns.num_turns, turn_len=ns.turn_len, think_time=ns.think_time, priority_classes=ns.priority_classes,
        tenants=ns.tenants, ttft_slo_ms=ns.ttft_slo_ms, ttft_slo_classes=ns.ttft_slo_classes,
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


def main(ns: argparse.Namespace) -> int:
    cost = make_cost_model(ns.cost_model, num_kv_heads=ns.kv_heads, step_overhead_ms=ns.step_overhead_ms,
                           ms_per_step=ns.ms_per_step, ms_per_token=ns.ms_per_token,
                           ms_per_context_token=ns.ms_per_context_token)
    base = server_args(ns, cost)
    t0 = time.perf_counter()
    specs = read_trace(ns.trace, ns.context_length) if ns.trace else generate(workload_config(ns))
    if ns.save_trace:
        write_trace(specs, ns.save_trace)
    print(f"[simulate] {len(specs)} requests ({'trace ' + ns.trace if ns.trace else ns.workload}), cost model "
          f"{cost.name}, KV pool {base.max_total_tokens} tokens, generated in {time.perf_counter() - t0:.1f} s",
          file=sys.stderr)
    runs = [args_for(base, item.strip()) for item in ns.compare.split(",")] if ns.compare else [("", base)]
    calm_garbage_collector()
    prof = None
    if ns.profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    traces: list[SimTrace] = []
    results: list[dict[str, Any]] = []
    for label, args in runs:
        label = label or (args.scheduler if args.scheduler == "unified" else args.schedule_policy)
        trace = run(args, specs, cost, ns.context_length, label=label, progress=not ns.no_progress,
                    skip_req_to_token_writes=ns.skip_req_to_token_writes, max_steps=ns.max_steps,
                    stream=ns.stream_output)
        traces.append(trace)
        results.append(summarize(trace, args))
    if prof is not None:
        import pstats

        prof.disable()
        prof.dump_stats(ns.profile)
        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(25)
    for res in results:
        print(summary_text(res))
        print()
    if len(results) > 1:
        print(compare_table(results))
    if ns.output:
        with open(ns.output, "w") as f:
            json.dump({"argv": sys.argv[1:], "results": results}, f, indent=1,
                      default=str)
    if ns.plot:
        plot(results, traces, ns.plot)
        print(f"[simulate] plot written to {ns.plot}", file=sys.stderr)
    return 0
