#!/usr/bin/env python
"""The AMX int8 kernel (csrc/gguf_amx8.cpp: tiles whose result does not depend on the row count)
against the VNNI integer kernel that decodes a bfloat16 model today (csrc/gguf_vnni.cpp), on every
block linear of a model whose type the AMX kernel packs (Q4_0, Q4_1, Q8_0).

    python scripts/bench_amx8.py [--model-path FILE] [--rows 1 2 4 8] [--repeat 9] [--output F.json]

For each row count, every such linear runs once, one after the other (the weights stream from
memory as in a forward), through each kernel in turn; the median of ``--repeat`` alternated runs
is printed with the ratio. What it tells: the cost of a decode row and of each extra row of a
speculative verify step (whose rows must compute what a decode row computes), kernel by kernel.
Needs a CPU with AMX (amx_int8) and AVX512-VNNI.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radixserve.model.dequant import amx8_ext, vnni_ext  # noqa: E402
from radixserve.model.gguf_blocks import GGUFWeight  # noqa: E402
from radixserve.model.model_runner import ModelRunner  # noqa: E402
from radixserve.results import write_result  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="a GGUF file (default: the bundled model)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8], help="rows of x (at most 8)")
    ap.add_argument("--repeat", type=int, default=9, help="alternated runs of each kernel per row count")
    ap.add_argument("--output", help="also write the figures here as JSON (radixserve/results.py)")
    args = ap.parse_args()
    amx8, vnni = amx8_ext(), vnni_ext()
    if amx8 is None or vnni is None:
        sys.exit("needs a CPU with AMX int8 and AVX512-VNNI (and a compiler to build the kernels)")
    runner = ModelRunner(args.model_path, dtype="bfloat16")
    segs = [s for m in runner.model.modules() if isinstance(getattr(m, "_quant", None), GGUFWeight)
            for s in m._quant.segments if amx8.supported(s.qtype)]
    if not segs:
        sys.exit("the model has no Q4_0, Q4_1 or Q8_0 matrices")
    packed = [amx8.pack(s.data.contiguous(), s.qtype) for s in segs]
    print(f"{len(segs)} matrices ({sum(s.data.numel() for s in segs) / 2**20:.0f} MiB of blocks), "
          f"{torch.get_num_threads()} threads")
    figures: dict[str, dict[str, float]] = {}
    for rows in args.rows:
        xs = {s.cols: torch.randn(rows, s.cols, dtype=torch.bfloat16) for s in segs}
        times: dict[str, list[float]] = {"vnni": [], "amx8": []}
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            for s in segs:
                vnni.linear(xs[s.cols], s.data, s.qtype)
            times["vnni"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for s, p in zip(segs, packed, strict=True):
                amx8.linear(xs[s.cols], p, s.qtype, s.data.shape[0], s.cols)
            times["amx8"].append(time.perf_counter() - t0)
        v, a = statistics.median(times["vnni"]) * 1e3, statistics.median(times["amx8"]) * 1e3
        figures[str(rows)] = {"vnni_ms": v, "amx8_ms": a, "ratio": a / v}
        print(f"rows {rows:2d}: VNNI {v:7.2f} ms   AMX int8 {a:7.2f} ms   {a / v:.2f}x the time", flush=True)
    if args.output:
        write_result(args.output, {"model": args.model_path or "bundled", "rows": figures})


if __name__ == "__main__":
    main()
