#!/usr/bin/env python
"""Whole decode step (``ModelRunner.forward``: model + greedy sampling) per ``--quantization``.

    python scripts/bench_quant_step.py [--batches 1 32 64] [--ctx 256] [--quantizations none int8 int4]

A quantization may name its kernel (quant.py ``quantize_weight``): ``int4:aten`` against ``int4:block``
compares ATen's kernel with csrc/block_gemm.cpp in one run; plain ``int4`` is the engine's choice.
``gguf`` reads a GGUF model's own blocks at every batch (gguf_blocks.py; row by row up to the
engine's default rows unless ``--quant-max-rows`` says otherwise)::

    python scripts/bench_quant_step.py --batches 1 4 16 64 --quantizations none gguf

``gguf@N`` is ``gguf`` with bfloat16 inputs of up to N rows on the VNNI integer kernel (the bf16 row
kernel past them) for every weight: where the two kernels cross over::

    python scripts/bench_quant_step.py --batches 4 5 6 8 --quantizations gguf@4 gguf@8 --quant-max-rows 16

One runner per quantization, all loaded in this process; for each batch the runners are timed in
turn, round after round (``--rounds``), so a busy machine slows them alike. Prints the median and
the minimum step per runner and each one's ratio to the first (``none``: the float weights), and
the bytes of weights a step reads at batch 1 (quantized copies, or the float weights).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radixserve.model.gguf_blocks import GGUFWeight  # noqa: E402
from radixserve.model.linear import Linear  # noqa: E402
from radixserve.model.model_runner import ModelRunner  # noqa: E402
from radixserve.model.quant import DEFAULT_MAX_ROWS, DEFAULT_MAX_ROWS_BF16  # noqa: E402

_spec = importlib.util.spec_from_file_location("bench_model_step", Path(__file__).with_name("bench_model_step.py"))
assert _spec is not None and _spec.loader is not None
_step = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_step)


def weight_bytes(runner: ModelRunner, rows: int) -> int:
    """Bytes of linear weights a forward of ``rows`` rows reads (the LM head: once, as one matrix)."""
    total = 0
    for m in runner.model.modules():
        if not isinstance(m, Linear):
            continue
        q = m._quant
        if q is not None and (rows <= m.quant_max_rows or m.in_blocks):
            total += q.nbytes
        else:
            total += m.out_features * m.in_features * runner.dtype.itemsize
    return total


def set_vnni_rows(runner: ModelRunner, rows: int) -> None:
    """Every GGUF weight of ``runner`` takes the VNNI kernel up to ``rows`` bfloat16 rows."""
    for m in runner.model.modules():
        if isinstance(m, Linear) and isinstance(m._quant, GGUFWeight):
            m._quant.vnni_rows = rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 64])
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--quantizations", nargs="+", default=["none", "int8", "int4"],
                    help="none, gguf, int8 or int4, the last two optionally :block or :aten (the kernel)")
    ap.add_argument("--quant-max-rows", type=int, default=None,
                    help=f"rows up to which the quantized kernel runs (default: every batch measured; "
                         f"the engine's default is {DEFAULT_MAX_ROWS_BF16} in bfloat16, {DEFAULT_MAX_ROWS} in float32)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    max_rows = args.quant_max_rows if args.quant_max_rows is not None else max(args.batches)
    runners = {
        q: ModelRunner(args.model, dtype=args.dtype, attention_backend=args.attention_backend,
                       quantization=q.partition("@")[0].partition(":")[0], quant_kernel=q.partition(":")[2] or "auto",
                       quant_max_rows=args.quant_max_rows if q == "gguf" else max_rows, num_threads=args.threads,
                       progress=False)
        for q in args.quantizations
    }
    for q, runner in runners.items():
        if "@" in q:
            set_vnni_rows(runner, int(q.partition("@")[2]))
    first = next(iter(runners.values()))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, cpu {torch.backends.cpu.get_cpu_capability()}, "
          f"dtype {first.dtype}, attention {args.attention_backend}, context {args.ctx}, quantized up to {max_rows} rows, "
          f"{args.rounds} rounds")
    print(f"{'batch':>5} {'quantization':>12} {'weights MB':>10} {'median ms':>10} {'min ms':>8} {'x none (median)':>16} {'tok/s':>8}")
    for batch in args.batches:
        fbs = {q: _step.decode_batch(r, batch, args.ctx) for q, r in runners.items()}
        times: dict[str, list[float]] = {q: [] for q in runners}
        with torch.inference_mode():
            for q, r in runners.items():  # warm-up
                r.forward(fbs[q])
                r.forward(fbs[q])
            for _ in range(args.rounds):
                for q, r in runners.items():
                    t = time.perf_counter()
                    r.forward(fbs[q])
                    times[q].append((time.perf_counter() - t) * 1000)
        base = statistics.median(times[args.quantizations[0]])
        for q, r in runners.items():
            med = statistics.median(times[q])
            print(f"{batch:>5} {q:>12} {weight_bytes(r, batch) / 1e6:>10.0f} {med:>10.1f} {min(times[q]):>8.1f} "
                  f"{med / base:>16.2f} {batch / med * 1000:>8.1f}")


if __name__ == "__main__":
    main()
