"""``radixserve bench offline``: the in-process engine on a fixed workload, optionally next to
HF transformers ``generate`` (static batches) on the same prompts, same dtype, same run.

Prints output tok/s, total tok/s, cache hit rate, TTFT P50/P95, the KV pool's memory the run
touched (the sliding-window layers' share apart), and the decode step time at a given batch next
to the time the model's matmuls alone take at that batch.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from tqdm import tqdm

from radixserve.bench.workloads import BenchRequest, make_workload
from radixserve.engine import Engine
from radixserve.results import write_result


@dataclass
class OfflineResult:
    engine: str
    workload: str
    num_requests: int
    duration_s: float
    output_tokens: int
    input_tokens: int
    output_throughput: float
    total_throughput: float
    cache_hit_rate: float | None
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    retractions: int = 0  # the sglang scheduler's decode retractions
    preemptions: int = 0  # priority preemptions, and the unified scheduler's recompute preemptions


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def run_engine(engine: Engine, reqs: list[BenchRequest], workload: str, label: str = "radixserve") -> OfflineResult:
    stats = engine.scheduler.stats
    cached0, prompt0, retract0 = stats.cached_tokens, stats.prompt_tokens, stats.num_retractions
    preempt0 = stats.num_preemptions
    t0 = time.perf_counter()
    outs = engine.generate(
        input_ids=[r.input_ids for r in reqs],
        sampling_params=[{"max_new_tokens": r.max_new_tokens, "temperature": 0.0, "ignore_eos": True} for r in reqs],
    )
    dur = time.perf_counter() - t0
    assert isinstance(outs, list)
    n_out = sum(len(o["output_ids"]) for o in outs)
    n_in = sum(len(r.input_ids) for r in reqs)
    ttfts = [o["meta_info"]["ttft"] for o in outs if o["meta_info"].get("ttft") is not None]
    prompt = stats.prompt_tokens - prompt0
    return OfflineResult(
        label, workload, len(reqs), dur, n_out, n_in, n_out / dur, (n_in + n_out) / dur,
        (stats.cached_tokens - cached0) / prompt if prompt else 0.0,
        percentile(ttfts, 50), percentile(ttfts, 95), stats.num_retractions - retract0,
        stats.num_preemptions - preempt0,
    )


def run_hf(engine: Engine, reqs: list[BenchRequest], workload: str, batch_size: int = 32) -> OfflineResult:
    """HF transformers LlamaForCausalLM.generate on our dequantized weights, static batches."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from radixserve.model.loader import load_model

    runner = engine.runner
    cfg = LlamaConfig(**runner.model_config.to_hf_dict())
    dtype = runner.dtype
    from transformers.initialization import no_init_weights

    with no_init_weights():  # every weight is loaded below: a random init first is seconds wasted
        model = LlamaForCausalLM(cfg)
    model = model.to(dtype)  # type: ignore[arg-type]
    model.load_state_dict(load_model(runner.model_path, dtype, progress=False)[1], strict=False)
    model.tie_weights()
    model.eval()
    pad = runner.model_config.eos_token_id or 0
    t0 = time.perf_counter()
    n_out = 0
    ttfts: list[float] = []
    for i in tqdm(range(0, len(reqs), batch_size), desc="hf generate", file=sys.stderr):
        chunk = reqs[i : i + batch_size]
        width = max(len(r.input_ids) for r in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for j, r in enumerate(chunk):  # left padding
            ids[j, width - len(r.input_ids) :] = torch.tensor(r.input_ids)
            mask[j, width - len(r.input_ids) :] = 1
        new = max(r.max_new_tokens for r in chunk)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=pad)
        n_out += (out.shape[1] - width) * len(chunk)
        ttfts.extend([time.perf_counter() - t0] * len(chunk))  # upper bound: a batch ends together
    dur = time.perf_counter() - t0
    n_in = sum(len(r.input_ids) for r in reqs)
    return OfflineResult("hf-transformers", workload, len(reqs), dur, n_out, n_in, n_out / dur,
                         (n_in + n_out) / dur, None, None, None)


def matmul_only_ms(engine: Engine, batch: int, iters: int = 5) -> float:
    """Time of the model's GEMMs alone for one decode step at ``batch`` rows."""
    mc = engine.runner.model_config
    dtype = engine.runner.dtype
    h, kv = mc.hidden_size, mc.num_kv_heads * mc.head_dim
    q = mc.num_heads * mc.head_dim
    shapes = [(h, q + 2 * kv), (q, h), (h, 2 * mc.intermediate_size), (mc.intermediate_size, h)]
    ws = [torch.randn(o, i, dtype=dtype) for i, o in shapes]
    head = torch.randn(mc.vocab_size, h, dtype=dtype)
    xs = [torch.randn(batch, i, dtype=dtype) for i, _ in shapes]
    xh = torch.randn(batch, h, dtype=dtype)

    def once() -> None:
        for _ in range(mc.num_layers):
            for x, w in zip(xs, ws, strict=True):
                torch.nn.functional.linear(x, w)
        torch.nn.functional.linear(xh, head)

    once()
    t0 = time.perf_counter()
    for _ in range(iters):
        once()
    return (time.perf_counter() - t0) / iters * 1000


def decode_step_ms(engine: Engine, batch: int, input_len: int = 256, steps: int = 16) -> tuple[float, float]:
    """Median wall time of decode steps with exactly ``batch`` running requests, as
    ``(whole engine step, runner forward)``. The whole step runs from one ``Scheduler.step`` call to
    the next: scheduling, the forward, result processing and the engine's detokenization."""
    reqs = make_workload("random", num_prompts=batch, input_len=input_len, output_len=steps + 1, seed=123)
    sched = engine.scheduler
    log = sched.stats.step_log  # a bounded deque: compare entries, not lengths
    starts: list[tuple[float, Any]] = []  # (start time, the step_log entry this step appended or None)
    # the engine steps with step_overlapped under the overlap loop (it logs each step one step late:
    # the time between two calls is still one step of the pipeline)
    name = "step_overlapped" if sched.overlap_enabled() else "step"
    inner = getattr(sched, name)

    def timed_step() -> list[Any]:
        t0 = time.perf_counter()
        before = log[-1] if log else None
        out = inner()
        after = log[-1] if log else None
        starts.append((t0, after if after is not before else None))
        return out

    setattr(sched, name, timed_step)
    try:
        run_engine(engine, reqs, "decode-probe")
    finally:
        delattr(sched, name)  # back to the class's method
    pairs = [  # (whole step, its forward) for every step that decoded exactly ``batch`` requests
        (t1 - t0, e[3]) for (t0, e), (t1, _) in zip(starts, starts[1:], strict=False)
        if e is not None and e[0] == "DECODE" and e[1] == batch
    ]
    return _median_ms([w for w, _ in pairs]), _median_ms([f for _, f in pairs])


def compare_loops(engine: Engine, batch: int, rounds: int) -> dict[str, float]:
    """The whole decode step at ``batch`` under the overlap loop and the normal loop, alternated
    ``rounds`` times each (the machine drifts); prints the medians and their ratio."""
    settings = engine.scheduler.settings
    base = settings.args
    got: dict[str, list[float]] = {"overlap": [], "normal": []}
    try:
        for _ in range(rounds):
            for loop in ("overlap", "normal"):
                settings.args = base.replace(overlap_schedule="off" if loop == "normal" else "on")
                engine.flush_cache()
                got[loop].append(decode_step_ms(engine, batch)[0])
    finally:
        settings.args = base
    med = {k: statistics.median(v) for k, v in got.items()}
    print(f"whole decode step at batch {batch}, {rounds} alternated rounds: overlap {med['overlap']:.1f} ms, "
          f"normal {med['normal']:.1f} ms (overlap / normal {med['overlap'] / med['normal']:.2f}x)")
    return {"step_ms_overlap": med["overlap"], "step_ms_normal": med["normal"]}


def compare_attention(engine: Engine, batch: int, rounds: int, backends: tuple[str, ...]) -> dict[str, float]:
    """The whole decode step at ``batch`` with each attention backend, swapped into the one loaded
    model and alternated ``rounds`` times (the machine drifts); prints the medians and the ratio."""
    from radixserve.model.attention_backend import create_attention_backend

    model = engine.runner.model
    base = model.attn_backend
    made = {n: create_attention_backend(n, base.num_heads, base.num_kv_heads, base.head_dim) for n in backends}
    got: dict[str, list[float]] = {n: [] for n in backends}
    try:
        for _ in range(rounds):
            for n in backends:
                model.attn_backend = made[n]
                engine.flush_cache()
                got[n].append(decode_step_ms(engine, batch)[0])
    finally:
        model.attn_backend = base
    med = {n: statistics.median(v) for n, v in got.items()}
    first, last = backends[0], backends[-1]
    print(f"whole decode step at batch {batch}, {rounds} alternated rounds: "
          + ", ".join(f"{n} {med[n]:.1f} ms" for n in backends)
          + f" ({first} / {last} {med[first] / med[last]:.2f}x)")
    return {f"step_ms_{n}": med[n] for n in backends}


def compare_small_ops(engine: Engine, batch: int, rounds: int) -> dict[str, float]:
    """The whole decode step at ``batch`` with the torch small ops and the fused C++ ones (fused_ops.py),
    switched on the one loaded model and alternated ``rounds`` times; prints the medians and the ratio."""
    model = engine.runner.model
    base = model.small_ops
    names = ("torch", "cpp")
    got: dict[str, list[float]] = {n: [] for n in names}
    try:
        for _ in range(rounds):
            for n in names:
                model.set_small_ops(n)
                engine.flush_cache()
                got[n].append(decode_step_ms(engine, batch)[0])
    finally:
        model.small_ops = base
    med = {n: statistics.median(v) for n, v in got.items()}
    mm = matmul_only_ms(engine, batch)
    print(f"whole decode step at batch {batch}, {rounds} alternated rounds: "
          + ", ".join(f"{n} ops {med[n]:.1f} ms ({med[n] / mm:.2f}x the matmuls)" for n in names)
          + f"; matmuls alone {mm:.1f} ms; torch / cpp {med['torch'] / med['cpp']:.2f}x")
    return {f"step_ms_{n}_ops": med[n] for n in names}


def kv_memory(engine: Engine) -> tuple[str, dict[str, float]]:
    """The KV pool's memory the run touched (written at least once) against what is mapped, and the
    sliding-window layers' share where the model has them: a line to print, and the figures (MiB)."""
    pool, cfg = engine.runner.kv_pool, engine.runner.model_config
    assert pool is not None
    mib = 2**20
    touched, mapped = pool.resident_bytes()
    figs = {"kv_touched_mib": touched / mib, "kv_mapped_mib": mapped / mib}
    line = f"KV pool touched: {touched / mib:.1f} MiB of {mapped / mib:.1f} MiB mapped"
    if cfg.sliding_layers:
        lt, lm = pool.resident_bytes(cfg.sliding_layers)
        figs["kv_sliding_touched_mib"] = lt / mib
        own = "own pages" if engine.scheduler.kv.window_kv is not None else "every position"
        line += (f" (the {len(cfg.sliding_layers)} sliding-window layers, {own}: {lt / mib:.1f} of {lm / mib:.1f} MiB; "
                 f"the {cfg.num_layers - len(cfg.sliding_layers)} others: {(touched - lt) / mib:.1f} MiB)")
    return line, figs


def _median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1000 if xs else float("nan")


def main(args: Any) -> int:
    kw: dict[str, Any] = {}
    if args.max_total_tokens:
        kw["max_total_tokens"] = args.max_total_tokens
    if args.max_running_requests:
        kw["max_running_requests"] = args.max_running_requests
    if args.scheduler != "sglang":
        kw["scheduler"] = args.scheduler
    kw["overlap_schedule"] = args.overlap_schedule
    kw["attention_backend"] = args.attention_backend
    kw["quantization"] = args.quantization
    if args.disable_hybrid_swa_memory:
        kw["disable_hybrid_swa_memory"] = True
    engine = Engine(args.model_path, dtype=args.dtype, schedule_policy=args.schedule_policy, **kw)
    wl_kw: dict[str, int] = {"seed": args.seed}
    if args.num_prompts:
        wl_kw["num_prompts" if args.workload != "shared-prefix" else "prompts_per_group"] = args.num_prompts
    for name in ("input_len", "output_len"):
        if getattr(args, name, None):
            if args.workload != "random":
                raise SystemExit(f"--{name.replace('_', '-')} is for the random workload")
            wl_kw[name] = getattr(args, name)
    reqs = make_workload(args.workload, **wl_kw)
    # warm-up (one tiny request), so the first timed step does not pay lazy initialisation
    engine.generate(input_ids=reqs[0].input_ids[:16], sampling_params={"max_new_tokens": 2})
    engine.flush_cache()
    results = [run_engine(engine, reqs, args.workload)]
    if args.compare_hf:
        results.append(run_hf(engine, reqs, args.workload, args.hf_batch_size))
    print(f"\n{'engine':<18}{'out tok/s':>11}{'total tok/s':>13}{'hit rate':>10}{'TTFT p50':>10}{'TTFT p95':>10}"
          f"{'time s':>8}")
    for r in results:
        hit = f"{r.cache_hit_rate:.1%}" if r.cache_hit_rate is not None else "-"
        p50 = f"{r.ttft_p50_s:.2f}" if r.ttft_p50_s is not None else "-"
        p95 = f"{r.ttft_p95_s:.2f}" if r.ttft_p95_s is not None else "-"
        print(f"{r.engine:<18}{r.output_throughput:>11.1f}{r.total_throughput:>13.1f}{hit:>10}{p50:>10}{p95:>10}"
              f"{r.duration_s:>8.1f}")
    line, extra = kv_memory(engine)
    print(line)
    if args.compare_hf:
        print(f"ratio radixserve / HF output throughput: {results[0].output_throughput / results[1].output_throughput:.2f}x")
    if args.decode_batch:
        engine.flush_cache()
        step, fwd = decode_step_ms(engine, args.decode_batch)
        mm = matmul_only_ms(engine, args.decode_batch)
        extra.update({"decode_step_ms": step, "decode_forward_ms": fwd, "matmul_only_ms": mm})
        loop = "overlap" if engine.scheduler.overlap_enabled() else "normal"
        print(f"decode step at batch {args.decode_batch} ({loop} loop): {step:.1f} ms (runner forward {fwd:.1f} ms); "
              f"model matmuls alone: {mm:.1f} ms (step / matmuls {step / mm:.2f}x)")
    if args.decode_batch and args.compare_loops:
        extra.update(compare_loops(engine, args.decode_batch, args.compare_loops))
    if args.decode_batch and args.compare_attention:
        extra.update(compare_attention(engine, args.decode_batch, args.compare_attention, ("torch_native", "cpu_paged")))
    if args.decode_batch and args.compare_small_ops:
        extra.update(compare_small_ops(engine, args.decode_batch, args.compare_small_ops))
    print(f"dtype: {engine.runner.dtype}, attention backend: {args.attention_backend}, "
          f"quantization: {args.quantization}")
    if args.output:
        write_result(args.output, {"results": [asdict(r) for r in results], **extra, "dtype": str(engine.runner.dtype)})
    return 0
