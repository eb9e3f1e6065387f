#!/usr/bin/env python
"""Time one decode step of the real model against its matmuls alone, per dtype.

    python scripts/bench_model_step.py [--batch 64] [--ctx 256] [--dtypes float32 bfloat16]

For each dtype it prints (median over --iters runs, milliseconds):

- ``matmul F.linear``: plain ``F.linear`` GEMMs of the model's shapes on ``batch`` rows -- per layer
  q, k, v, o, gate, up, down (each layer its own weights), plus the LM head -- the yardstick;
- ``matmul as model``: the same work as the model does it (fused qkv and gate_up, oneDNN-packed
  weights in float32);
- ``model forward``: ``LlamaForCausalLM.forward`` for a decode batch (``batch`` requests, each with
  ``ctx - 1`` cached tokens + 1 new one) incl. attention over the KV pool and the LM head;
- ``runner step``: ``ModelRunner.forward`` (forward + greedy sampling + list conversion);
- ``attention only``: the attention backend's 30 layer calls (KV write + gather + SDPA);
- ``prefill``: tokens/s of one ``--prefill``-token prompt.

``--sweep`` instead prints (minimum times), per dtype, batch (``--batches``) and context (``--ctxs``), the model
forward and the runner step with each of ``--small-ops`` (the torch reference and the fused C++
ops, alternated over ``--rounds``) against the plain ``F.linear`` GEMMs at that batch, and prefill
of one ``--prefill``-token chunk against the GEMMs alone on that many rows. With the cpu_paged
extension built it also prints the time to read every layer's K/V rows of the batch and nothing
else (``KV read``) and ``floor/mm`` = (matmuls + KV read) / matmuls: the least a decode step can
be against its GEMMs on this machine when the layers run one after another::

    python scripts/bench_model_step.py --sweep --dtypes float32 bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radixserve.mem.forward_batch import ForwardBatch, SamplingBatchInfo  # noqa: E402
from radixserve.model.model_runner import ModelRunner  # noqa: E402

MINS: dict[str, float] = {}
CLOCK: Callable[[], float] = time.perf_counter


def timeit(fn: Callable[[], object], iters: int, warmup: int = 2, key: str = "") -> float:
    """Median milliseconds; the minimum goes to MINS[key] (robust to a busy shared machine)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t = CLOCK()
        fn()
        times.append(CLOCK() - t)
    if key:
        MINS[key] = min(times) * 1000
    return statistics.median(times) * 1000


def decode_batch(
    runner: ModelRunner, batch: int, ctx: int, seed: int = 0, slots: str = "paged"
) -> ForwardBatch:
    """``batch`` requests with ``ctx - 1`` tokens already cached, +1 new each.

    ``slots``: where their KV lives -- "paged": shuffled pages of 16 slots (a pool after some churn),
    "random": every token anywhere (worst case), "contiguous": one run per request (fresh pool)."""
    page = 16
    n = batch * ctx
    kv = runner.make_kv_pool(n + page, page_size=page)
    r2t = runner.make_req_to_token_pool(batch, ctx)
    runner.attach_pools(kv, r2t)
    g = torch.Generator().manual_seed(seed)
    if slots == "random":
        order = torch.randperm(n, generator=g)
    elif slots == "paged":
        pages = torch.randperm(n // page, generator=g)
        order = (pages.view(-1, 1) * page + torch.arange(page)).view(-1)
    else:
        order = torch.arange(n)
    r2t.req_to_token[:, :ctx] = (order + page).view(batch, ctx)
    for buf in kv.k_buffers + kv.v_buffers:
        buf.normal_(generator=g)
    return ForwardBatch(
        input_ids=torch.randint(0, runner.model_config.vocab_size, (batch,), generator=g),
        positions=torch.full((batch,), ctx - 1, dtype=torch.int64),
        out_cache_loc=r2t.req_to_token[:, ctx - 1].clone(),
        req_pool_indices=torch.arange(batch),
        seq_lens=torch.full((batch,), ctx, dtype=torch.int64),
        extend_prefix_lens=[ctx - 1] * batch,
        extend_seq_lens=[1] * batch,
        sampling=SamplingBatchInfo.greedy(batch),
    )


def prefill_batch(runner: ModelRunner, n: int) -> ForwardBatch:
    page = 16
    kv = runner.make_kv_pool(n + page, page_size=page)
    r2t = runner.make_req_to_token_pool(1, n)
    runner.attach_pools(kv, r2t)
    r2t.req_to_token[0, :n] = torch.arange(n) + page
    return ForwardBatch(
        input_ids=torch.randint(0, runner.model_config.vocab_size, (n,)),
        positions=torch.arange(n),
        out_cache_loc=torch.arange(n) + page,
        req_pool_indices=torch.zeros(1, dtype=torch.int64),
        seq_lens=torch.tensor([n]),
        extend_prefix_lens=[0],
        extend_seq_lens=[n],
        sampling=SamplingBatchInfo.greedy(1),
    )


def matmul_plain(runner: ModelRunner, batch: int, dtype: torch.dtype, iters: int) -> float:
    """Separate q, k, v, o, gate, up, down GEMMs per layer (own weights per layer, so small batches
    stream the weights from memory as the model does) + the LM head, with plain ``F.linear``."""
    c = runner.model_config
    h, i = c.hidden_size, c.intermediate_size
    shapes = [(c.q_size, h), (c.kv_size, h), (c.kv_size, h), (h, c.q_size), (i, h), (i, h), (h, i)]
    layers = [[torch.randn(o, k, dtype=dtype) for o, k in shapes] for _ in range(c.num_layers)]
    lm = torch.randn(c.vocab_size, h, dtype=dtype)
    xs = {k: torch.randn(batch, k, dtype=dtype) for k in {h, i, c.q_size}}

    def run() -> None:
        for ws in layers:
            for w in ws:
                F.linear(xs[w.shape[1]], w)
        F.linear(xs[h], lm)

    return timeit(run, iters, key="matmul F.linear")


def matmul_as_model(runner: ModelRunner, batch: int, iters: int) -> float:
    m = runner.model
    c = runner.model_config
    dtype = runner.dtype
    x_h = torch.randn(batch, c.hidden_size, dtype=dtype)
    x_q = torch.randn(batch, c.q_size, dtype=dtype)
    x_i = torch.randn(batch, c.intermediate_size, dtype=dtype)

    def run() -> None:
        for layer in m.layers:
            layer.self_attn.qkv_proj(x_h)
            layer.self_attn.o_proj(x_q)
            layer.mlp.gate_up_proj(x_h)
            layer.mlp.down_proj(x_i)
        m.lm_head(x_h)

    return timeit(run, iters, key="matmul as model")


def attention_only(runner: ModelRunner, fb: ForwardBatch, iters: int) -> float:
    c = runner.model_config
    B = fb.batch_size
    q = torch.randn(B, c.num_heads, c.head_dim, dtype=runner.dtype)
    k = torch.randn(B, c.num_kv_heads, c.head_dim, dtype=runner.dtype)
    v = torch.randn_like(k)
    backend = runner.model.attn_backend
    kv, r2t = runner.kv_pool, runner.req_to_token_pool
    assert kv is not None and r2t is not None

    def run() -> None:
        backend.init_forward_metadata(fb, r2t)
        for layer in range(c.num_layers):
            backend.forward(q, k, v, layer, fb, kv, r2t)

    return timeit(run, iters, key="attention only")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: bundled SmolLM2 GGUF)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--no-pack", action="store_true", help="do not pre-pack weights for oneDNN")
    ap.add_argument("--slots", choices=["paged", "random", "contiguous"], default="paged")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--attention-backend", default="torch_native", help="torch_native or cpu_paged")
    ap.add_argument("--quantization", default="none", choices=["none", "auto", "gguf", "int8", "int4"],
                    help="weight-only quantized linears: int8/int4 at every batch measured here, auto/gguf up to "
                         "the engine's default rows (docs/model.md)")
    ap.add_argument("--no-tune-malloc", action="store_true", help="leave glibc malloc at its defaults")
    ap.add_argument("--sweep", action="store_true", help="batches x contexts x small ops (see above)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 64, 128])
    ap.add_argument("--ctxs", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--small-ops", nargs="+", default=["torch", "cpp"], help="with --sweep: torch, cpp")
    ap.add_argument("--rounds", type=int, default=3, help="with --sweep: alternated rounds")
    ap.add_argument("--max-kv-gib", type=float, default=3.0, help="with --sweep: skip larger KV pools")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time this thread's CPU time instead of the wall clock (implies --threads 1): on a machine "
                    "that other work loads, a 1-thread run's CPU time is its own work, the wall clock is not")
    args = ap.parse_args()
    if args.cpu_time:
        global CLOCK
        CLOCK = time.thread_time
        args.threads = 1

    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, cpu {torch.backends.cpu.get_cpu_capability()}"
    )
    print(
        f"decode step: batch {args.batch}, context {args.ctx} ({args.slots} KV slots); "
        f"prefill {args.prefill} tokens; median of {args.iters}"
    )
    for name in args.dtypes:
        if args.sweep:
            sweep_dtype(args, name)
        else:
            bench_dtype(args, name)


def sweep_decode(
    runner: ModelRunner, fb: ForwardBatch, ops: list[str], args: argparse.Namespace
) -> tuple[dict[str, float], dict[str, float]]:
    """Per ops, the model forward's and the runner step's minimum over the alternated rounds (the
    minimum: on a shared machine the other figures measure the neighbours)."""
    model, kv, r2t = runner.model, runner.kv_pool, runner.req_to_token_pool
    assert kv is not None and r2t is not None
    fwd: dict[str, list[float]] = {o: [] for o in ops}
    step: dict[str, list[float]] = {o: [] for o in ops}
    for _ in range(args.rounds):
        for o in ops:
            model.set_small_ops(o)
            timeit(lambda: model(fb, kv, r2t), args.iters, key="fwd")
            fwd[o].append(MINS["fwd"])
            timeit(lambda: runner.forward(fb), args.iters, key="step")
            step[o].append(MINS["step"])
    return {o: min(v) for o, v in fwd.items()}, {o: min(v) for o, v in step.items()}


def kv_read_floor(runner: ModelRunner, fb: ForwardBatch, args: argparse.Namespace) -> float | None:
    """Minimum milliseconds to read every layer's K/V rows of the batch and compute nothing else
    (``read_kv_rows``: the decode kernel's own access pattern, prefetched): what attention costs at
    the least on this machine, whatever its arithmetic. None without the cpu_paged extension."""
    from radixserve.model.paged_attention import extension, extension_error

    if extension_error() is not None:
        return None
    ext, kv, r2t = extension(), runner.kv_pool, runner.req_to_token_pool
    assert kv is not None and r2t is not None

    def read_all() -> None:
        for k, v in zip(kv.k_buffers, kv.v_buffers, strict=True):
            ext.read_kv_rows(k, v, r2t.req_to_token, fb.req_pool_indices, fb.seq_lens)

    timeit(read_all, args.iters * args.rounds, key="kv floor")
    return MINS["kv floor"]


def sweep_dtype(args: argparse.Namespace, name: str) -> None:
    runner = ModelRunner(
        args.model,
        dtype=name,
        attention_backend=args.attention_backend,
        pack_weights=not args.no_pack,
        num_threads=args.threads,
        tune_malloc_arena=not args.no_tune_malloc,
        progress=False,
        quantization=args.quantization,
    )
    model, dtype = runner.model, runner.dtype
    print(f"\n[{dtype}, {args.attention_backend}, quantization {runner.quantization}] minimum of {args.iters} x {args.rounds} alternated rounds, ms")
    ops = args.small_ops
    head = "".join(f"{'fwd ' + o:>11}{'step ' + o:>11}{'step/mm':>8}" for o in ops)
    print(f"  {'batch':>5} {'ctx':>5} {'matmuls':>8}{head}{'KV read':>9}{'floor/mm':>9}")
    with torch.inference_mode():
        for batch in args.batches:
            matmul_plain(runner, batch, dtype, args.iters)
            mm = MINS["matmul F.linear"]
            for ctx in args.ctxs:
                kv_gib = runner.kv_bytes_per_token() * batch * ctx / 2**30
                if kv_gib > args.max_kv_gib:
                    print(f"  {batch:>5} {ctx:>5} skipped: KV pool {kv_gib:.1f} GiB > --max-kv-gib")
                    continue
                fb = decode_batch(runner, batch, ctx, slots=args.slots)
                fwd, step = sweep_decode(runner, fb, ops, args)
                floor = kv_read_floor(runner, fb, args)
                row = "".join(f"{fwd[o]:11.1f}{step[o]:11.1f}{step[o] / mm:7.2f}x" for o in ops)
                row += f"{floor:9.1f}{(mm + floor) / mm:8.2f}x" if floor is not None else ""
                print(f"  {batch:>5} {ctx:>5} {mm:8.1f}{row}", flush=True)
                runner.kv_pool = runner.req_to_token_pool = None  # free the pool before the next one
        matmul_plain(runner, args.prefill, dtype, max(2, args.iters // 3))
        mm = MINS["matmul F.linear"]
        pf = prefill_batch(runner, args.prefill)
        kv2, r2t2 = runner.kv_pool, runner.req_to_token_pool
        assert kv2 is not None and r2t2 is not None
        got: dict[str, list[float]] = {o: [] for o in ops}
        for _ in range(args.rounds):
            for o in ops:
                model.set_small_ops(o)
                timeit(lambda: runner.model(pf, kv2, r2t2), max(2, args.iters // 3), warmup=1, key="prefill")
                got[o].append(MINS["prefill"])
        print(f"  prefill {args.prefill} tokens: GEMMs alone {mm:.1f} ms = {args.prefill / mm * 1000:.0f} tok/s; "
              + ", ".join(f"{o} {min(v):.1f} ms = {mm / min(v):.0%} of GEMM-only"
                          for o, v in got.items()))
        print("  KV read: every layer's K/V rows of the batch read with nothing computed (the decode kernel's access "
              "pattern, prefetched); floor/mm: (matmuls + KV read) / matmuls, the least a step can be against its "
              "GEMMs when layers run one after another")


def bench_dtype(args: argparse.Namespace, name: str) -> None:
    runner = ModelRunner(
        args.model,
        dtype=name,
        attention_backend=args.attention_backend,
        pack_weights=not args.no_pack,
        num_threads=args.threads,
        tune_malloc_arena=not args.no_tune_malloc,
        progress=False,
        quantization=args.quantization,
        # int8/int4: the quantized copies at every measured size; auto/gguf: as the engine runs them
        quant_max_rows=max(args.batch, args.prefill) if args.quantization in ("int8", "int4") else None,
    )
    dtype = runner.dtype
    res: dict[str, float] = {}
    with torch.inference_mode():
        res["matmul F.linear"] = matmul_plain(runner, args.batch, dtype, args.iters)
        res["matmul as model"] = matmul_as_model(runner, args.batch, args.iters)
        fb = decode_batch(runner, args.batch, args.ctx, slots=args.slots)
        kv, r2t = runner.kv_pool, runner.req_to_token_pool
        assert kv is not None and r2t is not None
        res["model forward"] = timeit(lambda: runner.model(fb, kv, r2t), args.iters, key="model forward")
        res["runner step"] = timeit(lambda: runner.forward(fb), args.iters, key="runner step")
        res["attention only"] = attention_only(runner, fb, args.iters)
        pf = prefill_batch(runner, args.prefill)
        kv2, r2t2 = runner.kv_pool, runner.req_to_token_pool
        assert kv2 is not None and r2t2 is not None
        t_pf = timeit(lambda: runner.model(pf, kv2, r2t2), max(2, args.iters // 3), warmup=1)
    print(f"\n[{dtype}, {args.attention_backend}, quantization {args.quantization}] packed linears: "
          f"{runner.packed_linears}")
    print(f"  {'':<18} {'median':>9}    {'min':>6}")
    for k, v in res.items():
        print(f"  {k:<18} {v:9.1f} ms {MINS.get(k, float('nan')):6.1f} ms")
    ratio = res["model forward"] / res["matmul F.linear"]
    ratio_min = MINS["model forward"] / MINS["matmul F.linear"]
    print(f"  forward / F.linear matmuls = {ratio:.2f}x (min/min {ratio_min:.2f}x)")
    print(f"  decode throughput  {args.batch / res['runner step'] * 1000:9.1f} tok/s")
    print(f"  prefill {args.prefill:<10} {t_pf:9.1f} ms = {args.prefill / t_pf * 1000:.0f} tok/s")


if __name__ == "__main__":
    main()
