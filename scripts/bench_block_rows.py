#!/usr/bin/env python
"""Where GGUF blocks read in place should stop taking the row kernels for the tiled GEMM: the
default of ``--quantization-max-batch`` (radixserve/model/quant.py).

    python scripts/bench_block_rows.py [--model-path FILE] [--rows 4 8 12 16 32 64 256]

Loads the model as the server does in bfloat16 (its GGUF matrices kept in their blocks), then for
each row count runs every linear of the model once, one after the other (so the weights stream from
memory as in a forward), through the row kernels (VNNI / bf16, gguf_blocks.py) and through the
dequantized tiles and the GEMM; prints the best of ``--repeat`` for each, alternated. The crossover
is the smallest row count from which the tiles win.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radixserve.model.gguf_blocks import GGUFWeight  # noqa: E402
from radixserve.model.host import cpu_flags  # noqa: E402
from radixserve.model.model_runner import ModelRunner  # noqa: E402


def time_all(weights: list[GGUFWeight], rows: int, small_rows: int, repeat: int) -> float:
    """Best wall time (ms) of one input of ``rows`` rows through every weight."""
    xs = {w.in_features: torch.randn(rows, w.in_features, dtype=torch.bfloat16) for w in weights}
    for w in weights:
        w.small_rows = small_rows
        w(xs[w.in_features])  # warm-up
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for w in weights:
            w(xs[w.in_features])
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="a GGUF file (default: the bundled SmolLM2)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 12, 16, 32, 64, 256])
    ap.add_argument("--repeat", type=int, default=5, help="timed runs per row count and path")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    runner = ModelRunner(args.model_path, dtype="bfloat16", quantization="gguf", num_threads=args.threads,
                         progress=False)
    weights = [m._quant for m in runner.model.modules() if isinstance(getattr(m, "_quant", None), GGUFWeight)]
    amx = "amx_bf16" in cpu_flags()
    print(f"{len(weights)} block weights, {runner.num_threads} threads, AMX: {'yes' if amx else 'no'}")
    print(f"{'rows':>5} {'row kernels ms':>15} {'tiles+GEMM ms':>14} {'tiles/rows':>11}")
    for rows in args.rows:
        a, b = [], []
        for _ in range(2):  # alternated, so drift on a shared machine hits both
            a.append(time_all(weights, rows, 1 << 30, args.repeat))
            b.append(time_all(weights, rows, 0, args.repeat))
        print(f"{rows:>5} {min(a):>15.2f} {min(b):>14.2f} {min(b) / min(a):>11.2f}")


if __name__ == "__main__":
    main()
