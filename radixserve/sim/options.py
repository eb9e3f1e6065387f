"""``radixserve simulate``'s options (kept free of torch so building the CLI parser stays fast)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from radixserve.config import ServerArgs
from radixserve.sim.cost_model import COST_MODELS

# H100 80 GB, 90% for weights + KV, Llama-2-7B fp16 weights 13.5 GB: the default KV pool
GPU_MEM_BYTES = 80e9
GPU_MEM_FRACTION = 0.9
WEIGHT_BYTES = 13.5e9
LINEAR_DEFAULT_POOL = 200_000

# ServerArgs fields that mean nothing without a model or a server
_SKIP_GROUPS = ("model", "server")
EPILOG = """\
examples:
  radixserve simulate --num-requests 2000 --request-rate 40 --workload shared-prefix --compare fcfs,lpm,unified
  radixserve simulate --priority-classes 0:0.8,10:0.2 --enable-priority-scheduling --plot sim.png
  radixserve simulate --tenants a:10,b:1 --ttft-slo-ms 500 --output results.json
  radixserve simulate --trace trace.jsonl --cost-model linear --ms-per-step 8 --ms-per-token 0.05
  radixserve simulate --request-rate 2 --compare fcfs,fcfs:speculative_algorithm=draft --draft-acceptance 0.8
  radixserve simulate --workload multi-turn --num-turns 3 --prefix-len 200 --num-workers 64 --request-rate 64 \
      --num-requests 1536 --router-policy cache_aware,round_robin,power_of_two,cache_aware:balance_affinity=1
  radixserve simulate --workload multi-turn --num-turns 3 --num-workers 1 --dp-size 8 --concurrency 16 \
      --router-policy cache_aware,cache_aware:dp_aware=1 --router-cache-events

All latencies are in virtual time (the cost model's GPU); "scheduler overhead" is the real wall
time the scheduler spends per step on this machine and "scheduler CPU" its process CPU time, forward
excluded. See docs/simulator.md (one engine) and docs/router.md (fleets).
"""


def add_args(p: argparse.ArgumentParser) -> None:
    _workload_args(p)
    _cost_model_args(p)
    _fleet_args(p)
    _run_args(p)
    taken = set(p._option_string_actions)
    skip = tuple(f.name for f in dataclasses.fields(ServerArgs)
                 if f.metadata.get("group") in _SKIP_GROUPS or "--" + f.name.replace("_", "-") in taken)
    ServerArgs.add_cli_args(p, skip=skip)


def _workload_args(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("workload")
    w.add_argument("--num-requests", type=int, default=1000, help="Requests to generate (ignored with --trace).")
    w.add_argument("--workload", choices=["random", "shared-prefix", "multi-turn"], default="random",
                   help="random: independent prompts; shared-prefix: --num-prefix-groups system prompts of "
                        "--prefix-len tokens + an own part of --input-len; multi-turn: conversations of --num-turns "
                        "turns, each turn's prompt = the previous prompt + its answer + --turn-len new tokens.")
    w.add_argument("--request-rate", type=float, default=10.0,
                   help="Mean arrivals per second of virtual time (conversations/s for multi-turn); inf: all at t=0.")
    w.add_argument("--arrival", choices=["poisson", "bursty"], default="poisson",
                   help="poisson: exponential gaps; bursty: gamma gaps with coefficient of variation --burstiness.")
    w.add_argument("--burstiness", type=float, default=4.0, help="--arrival bursty: CV of the inter-arrival gaps (1 = Poisson).")
    w.add_argument("--input-len", type=int, default=512, help="Mean prompt tokens (own part for shared-prefix; first turn for multi-turn).")
    w.add_argument("--output-len", type=int, default=128,
                   help="Mean output tokens; each request's length is pre-sampled and the runner emits EOS there.")
    w.add_argument("--len-dist", choices=["fixed", "uniform", "exponential"], default="uniform",
                   help="Distribution of input and output lengths around their means.")
    w.add_argument("--range-ratio", type=float, default=0.5, help="--len-dist uniform: lengths in [mean(1-r), mean(1+r)].")
    w.add_argument("--num-prefix-groups", type=int, default=8, help="shared-prefix (and multi-turn with --prefix-len): number of distinct system prompts.")
    w.add_argument("--prefix-len", type=int, default=None,
                   help="Tokens of each system prompt: shared-prefix (default 1024), and multi-turn (default 0: "
                        "none), where conversation c opens with system prompt c %% --num-prefix-groups.")
    w.add_argument("--num-turns", type=int, default=4, help="multi-turn: turns per conversation.")
    w.add_argument("--turn-len", type=int, default=64, help="multi-turn: mean new user tokens per turn.")
    w.add_argument("--think-time", type=float, default=5.0, help="multi-turn: mean seconds between a conversation's turns (open loop).")
    w.add_argument("--priority-classes", default=None, metavar="VALUE:FRACTION,...",
                   help="Request priority classes, e.g. 0:0.8,10:0.2 (value:fraction); results are reported per class.")
    w.add_argument("--tenants", default=None, metavar="NAME:RATE,...",
                   help="Tenants with relative request rates, e.g. a:10,b:1; sets req.tenant; results per tenant.")
    w.add_argument("--ttft-slo-ms", type=float, default=None,
                   help="TTFT deadline: sets req.deadline = arrival + this (virtual seconds) and reports SLO attainment.")
    w.add_argument("--ttft-slo-classes", default=None, metavar="MS:FRACTION,...",
                   help="Mixed TTFT deadlines, e.g. 300:0.5,3000:0.5 (deadline ms:fraction of requests); "
                        "excludes --ttft-slo-ms.")
    w.add_argument("--tpot-slo-ms", type=float, default=None,
                   help="TPOT deadline for every request (mean ms per output token after the first): the scheduler "
                        "caps its running batch to hold it; reports TPOT and both-deadline attainment.")
    w.add_argument("--trace", default=None, metavar="FILE.jsonl",
                   help="Replay a JSONL trace (fields: arrival_time, prompt_len or input_ids, output_len, priority, "
                        "tenant, deadline_ms, prefix_group, prefix_len) instead of generating a workload.")
    w.add_argument("--save-trace", default=None, metavar="FILE.jsonl", help="Write the workload as a JSONL trace.")
    w.add_argument("--seed", type=int, default=0, help="Seed of the workload and of the scheduler's rng.")
    w.add_argument("--context-length", type=int, default=4096, help="Model context (Llama-2: 4096); sizes ReqToTokenPool.")


def _cost_model_args(p: argparse.ArgumentParser) -> None:
    c = p.add_argument_group("cost model")
    c.add_argument("--cost-model", choices=COST_MODELS, default="h100-llama2-7b",
                   help="h100-llama2-7b: measured Llama-2-7B operators on an H100 (bundled table) + analytic attention; "
                        "h100-llama2-7b-shared: the same from ../shared/data/vidur-h100-llama-2-7b/mlp.csv; "
                        "linear: --ms-per-step + --ms-per-token x tokens + --ms-per-context-token x context.")
    c.add_argument("--kv-heads", type=int, default=32,
                   help="h100 model: KV heads for the attention's KV bytes and the default pool (32: Llama-2-7B; 8: GQA like Llama-3-8B).")
    c.add_argument("--step-overhead-ms", type=float, default=0.5, help="h100 model: fixed time per step (launches, sampling, sync).")
    c.add_argument("--ms-per-step", type=float, default=10.0, help="linear model: fixed ms per step.")
    c.add_argument("--ms-per-token", type=float, default=0.1, help="linear model: ms per new (computed) token.")
    c.add_argument("--ms-per-context-token", type=float, default=0.0, help="linear model: ms per context token read.")
    c.add_argument("--kv-cache-dtype", choices=["auto", "bf16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8"], default="auto",
                   help="h100 model: the modelled GPU's KV. fp8 and int8 store a byte per value (per-tensor scales, as "
                        "SGLang's fp8 KV on a GPU): the default pool holds twice the tokens and decode attention reads "
                        "half the bytes; auto and bf16: two bytes.")
    c.add_argument("--pcie-gbps", type=float, default=50.0,
                   help="h100 model, --enable-hierarchical-cache: the host link's bandwidth (GB/s) that prefixes load "
                        "back over from the host tier, one load at a time per worker (PCIe Gen5 x16: ~50 achieved).")
    c.add_argument("--ms-per-loaded-token", type=float, default=0.0,
                   help="linear model, --enable-hierarchical-cache: ms per token loaded back from the host tier.")
    c.add_argument("--draft-acceptance", type=float, default=0.7,
                   help="--speculative-algorithm draft: the simulated draft model's chance that a draft token is the "
                        "request's own next token (a request keeps i drafts with probability this ** i).")
    c.add_argument("--draft-cost", type=float, default=0.05,
                   help="--speculative-algorithm draft: one draft forward's time as a fraction of the target's decode "
                        "step over the same batch (a step drafting k tokens adds k of them).")


def _fleet_args(p: argparse.ArgumentParser) -> None:
    f = p.add_argument_group("fleet: the router's policies in front of several engines (docs/router.md)")
    f.add_argument("--num-workers", type=int, default=1,
                   help="Simulated workers (each --dp-size engines) behind the router. More than 1, or --router-policy, "
                        "--dp-size, --dp-aware, --router-cache-events or --concurrency, runs a fleet; "
                        "--num-workers 1 alone is the single engine.")
    f.add_argument("--router-policy", default=None, metavar="POLICY[:field=value],...",
                   help="The router's policy (cache_aware, round_robin, random, power_of_two; default cache_aware). "
                        "Several, comma-separated, run one after the other and print one table; overrides per item, "
                        "e.g. cache_aware,cache_aware:balance_affinity=1,cache_aware:match=chars:dp_aware=1.")
    f.add_argument("--dp-size", type=int, default=1,
                   help="Data-parallel ranks per worker, each an engine of its own (own KV pool and radix cache).")
    f.add_argument("--dp-aware", action="store_true",
                   help="The router sees one target per DP rank and picks the rank; without it, it sees one per "
                        "worker and the worker's DP controller hands requests to its ranks in turn (round robin).")
    f.add_argument("--router-match", choices=["tokens", "chars"], default="tokens",
                   help="cache_aware's key: the prompt's token ids, or a text stand-in of 3-6 characters per token "
                        "(sgl-router matches characters, whose match rate is not the cache's token hit rate).")
    f.add_argument("--router-cache-events", action="store_true",
                   help="cache_aware: each engine's radix cache inserts and evictions also update the router's "
                        "tree (as the router's --enable-cache-events does), so it forgets what the engines evicted.")
    f.add_argument("--router-replicas", type=int, default=1,
                   help="Router replicas behind one address: requests reach them in turn, each routes with its own "
                        "tree and in-flight counts (all follow the same cache events with --router-cache-events); "
                        "reports the share of requests every replica would have routed alike.")
    f.add_argument("--cache-threshold", type=float, default=0.3,
                   help="cache_aware: a match rate above this routes to the target holding the prefix.")
    f.add_argument("--balance-abs-threshold", type=int, default=64,
                   help="cache_aware: imbalanced when max load - min load exceeds this (and the relative test holds).")
    f.add_argument("--balance-rel-threshold", type=float, default=1.5,
                   help="cache_aware: imbalanced when max load exceeds min load times this (and the absolute test holds).")
    f.add_argument("--balance-affinity", action="store_true",
                   help="cache_aware: when imbalanced, the best prefix match among the targets within the balance "
                        "window of the least loaded one, instead of the least loaded one.")
    f.add_argument("--router-max-concurrent-requests", type=int, default=-1,
                   help="The router's --max-concurrent-requests: requests in flight fleet-wide; the rest wait in "
                        "the router's queue (-1: no limit, no queue).")
    f.add_argument("--router-queue-size", type=int, default=1_000_000,
                   help="The router's --queue-size: past this many waiting, a request is refused (429).")
    f.add_argument("--router-priority", action="store_true",
                   help="The router's --enable-priority-scheduling: its queue serves the most important first.")
    f.add_argument("--router-tenant-fairness", action="store_true",
                   help="The router's --tenant-fairness: its queue serves tenants in VTC order, fleet-wide "
                        "(weights from --tenant-weights).")
    f.add_argument("--concurrency", type=int, default=None,
                   help="Closed loop: this many clients; each sends its conversation's next turn (or the next "
                        "conversation) as soon as its request finishes, with no think time. Default: open loop "
                        "at --request-rate.")


def _run_args(p: argparse.ArgumentParser) -> None:
    r = p.add_argument_group("run and output")
    r.add_argument("--compare", default=None, metavar="RUN,RUN,...",
                   help="Run several configurations on the same workload and print one table. RUN = a schedule policy "
                        "(fcfs, lpm, ...), unified, unified-priority or priority, optionally followed by :field=value "
                        "ServerArgs overrides, e.g. fcfs,lpm:lpm_fallback_threshold=0,unified.")
    r.add_argument("--output", default=None, metavar="FILE.json", help="Write every run's result dict as JSON.")
    r.add_argument("--plot", default=None, metavar="FILE.png", help="Plot KV usage over time and TTFT CDFs per class/run.")
    r.add_argument("--no-progress", action="store_true", help="No tqdm progress bar.")
    r.add_argument("--profile", default=None, metavar="FILE.prof",
                   help="cProfile the run(s), write the stats here and print the top 25 functions by own time.")
    r.add_argument("--max-steps", type=int, default=None,
                   help="Stop after this many forward steps (a bounded overhead measurement); unfinished requests "
                        "are left out of the latency results.")
    r.add_argument("--stream-output", action="store_true",
                   help="Every request streams: each decode step emits every running request's new token, as "
                        "for streaming API clients. Without it the requests are non-streaming calls, whose tokens "
                        "are emitted with the first one and at the finish (the scheduler's cheaper path).")
    r.add_argument("--charge-scheduler-time", action="store_true",
                   help="Advance the virtual clock by the scheduler's measured wall time per step too: all of it "
                        "with --overlap-schedule off, only what the forward does not cover with the overlap "
                        "loop (the default). Without it the virtual timeline is the cost model's forward alone.")
    r.add_argument("--skip-req-to-token-writes", action="store_true",
                   help="Use a ReqToTokenPool without its table (only a model reads it): faster at 1,000+ running, "
                        "but the scheduler overhead then leaves out the per-request table writes.")
    # every engine option too; a ServerArgs field whose flag a simulator option already owns is left out


def args_for(base: ServerArgs, spec: str) -> tuple[str, ServerArgs]:
    """One ``--compare`` item: ``NAME[:field=value:...]``. NAME is a schedule policy (``lpm``), a
    scheduler (``unified``), ``priority`` (sglang + --enable-priority-scheduling) or
    ``unified-priority``; the rest are ServerArgs overrides (``lpm:lpm_fallback_threshold=0``)."""
    from radixserve.config import SCHEDULE_POLICIES

    name, *overrides = spec.split(":")
    changes: dict[str, Any] = {}
    if name in ("unified", "unified-priority"):
        changes.update(scheduler="unified", schedule_policy="fcfs", enable_priority_scheduling=False,
                       scheduling_policy="priority" if name == "unified-priority" else "fcfs")
    elif name == "priority":
        changes.update(scheduler="sglang", scheduling_policy="fcfs", enable_priority_scheduling=True)
    elif name in SCHEDULE_POLICIES:
        changes.update(scheduler="sglang", scheduling_policy="fcfs", schedule_policy=name)
    elif name:
        raise ValueError(f"--compare: unknown item {name!r}; use a policy ({', '.join(SCHEDULE_POLICIES)}), "
                         "unified, unified-priority or priority, optionally with :field=value overrides")
    types = {f.name: f for f in dataclasses.fields(ServerArgs)}
    for ov in overrides:
        k, sep, v = ov.partition("=")
        k = k.strip().replace("-", "_")
        if not sep or k not in types:
            raise ValueError(f"--compare: bad override {ov!r} (want field=value with a ServerArgs field)")
        cur = getattr(base, k)
        val: Any
        if isinstance(cur, bool) or k.startswith(("enable_", "disable_")):
            val = v.lower() in ("1", "true", "yes", "on")
        elif v.lower() == "none":
            val = None
        elif isinstance(cur, int) or k in ("max_running_requests", "max_total_tokens", "max_queued_requests",
                                           "prefill_max_requests", "default_priority_value"):
            val = int(v)
        elif isinstance(cur, float) or str(types[k].type).startswith("float"):  # also float | None fields
            val = float(v)
        else:
            val = v
        changes[k] = val
    return spec, base.replace(**changes)
