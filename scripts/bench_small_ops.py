#!/usr/bin/env python
"""The small per-layer ops of one decode step alone: the torch reference against the fused C++ ops.

    python scripts/bench_small_ops.py [--rows 1 64 128 512] [--threads 1] [--cpu-time]

Per dtype and row count (tokens in the step), 30 layers of what the model runs between its GEMMs
and attention with SmolLM2-135M's shapes: two residual adds + RMSNorms, RoPE of q and k (12 heads
of 64 inside the qkv output), SiLU(gate) x up over 2 x 1536. Prints the minimum over --repeats of
each, alternated --rounds times, and the ratio.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radixserve.model.fused_ops import CppOps, TorchOps  # noqa: E402

LAYERS, HIDDEN, QKV, QK_HEADS, HEAD_DIM, INTER = 30, 576, 960, 12, 64, 1536


def small_ops_of_a_step(ops: TorchOps, t: dict[str, torch.Tensor], residual: torch.Tensor) -> None:
    rows = residual.shape[0]
    for _ in range(LAYERS):
        ops.add_rms_norm(t["x"], residual, t["w"], 1e-5)
        ops.rope(t["qkv"][:, : QK_HEADS * HEAD_DIM].view(rows, QK_HEADS, HEAD_DIM), t["cos"], t["sin"])
        ops.silu_mul(t["gu"])
        ops.add_rms_norm(t["x"], residual, t["w"], 1e-5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64, 128, 512])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cpu-time", action="store_true", help="this thread's CPU time (implies --threads 1)")
    args = ap.parse_args()
    clock = time.thread_time if args.cpu_time else time.perf_counter
    if args.cpu_time:
        args.threads = 1
    if args.threads:
        torch.set_num_threads(args.threads)
    impls: dict[str, TorchOps] = {"torch": TorchOps(), "cpp": CppOps()}
    print(f"{torch.get_num_threads()} threads, {'CPU time' if args.cpu_time else 'wall clock'}, "
          f"minimum of {args.repeats} x {args.rounds} rounds, {LAYERS} layers")
    for dname in args.dtypes:
        dtype = getattr(torch, dname)
        for rows in args.rows:
            t = {"x": torch.randn(rows, HIDDEN), "w": torch.randn(HIDDEN), "qkv": torch.randn(rows, QKV),
                 "cos": torch.randn(rows, HEAD_DIM // 2), "sin": torch.randn(rows, HEAD_DIM // 2),
                 "gu": torch.randn(rows, 2 * INTER)}
            t = {k: v.to(dtype) for k, v in t.items()}
            best = {name: float("inf") for name in impls}
            for _ in range(args.rounds):
                for name, ops in impls.items():
                    residual = torch.randn(rows, HIDDEN).to(dtype)
                    small_ops_of_a_step(ops, t, residual)  # warm-up
                    for _ in range(args.repeats):
                        t0 = clock()
                        small_ops_of_a_step(ops, t, residual)
                        best[name] = min(best[name], clock() - t0)
            a, b = best["torch"] * 1000, best["cpp"] * 1000
            print(f"  {dname:<9} rows {rows:>4}: torch {a:8.2f} ms   cpp {b:7.2f} ms   {a / b:5.1f}x", flush=True)


if __name__ == "__main__":
    main()
