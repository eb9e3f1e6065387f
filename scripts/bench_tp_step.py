#!/usr/bin/env python
"""Decode step time under tensor parallelism against tp 1, through the whole engine.

    python scripts/bench_tp_step.py [--model-path P] [--tp 1 3] [--batch 1 8] [--steps 48]

For each tp size it starts an ``Engine`` (tp > 1: ranks 1..N-1 as processes of this machine, each
with cores / N threads), decodes ``--steps`` tokens for ``batch`` random 64-token prompts, and prints
the median and minimum decode step (milliseconds, from the scheduler's step log: forward incl. the
broadcast, the collectives and sampling). A busy machine shows in the median; the minimum is the
steadier figure.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radixserve.engine import Engine  # noqa: E402


def decode_steps(model_path: str | None, tp: int, batch: int, steps: int, dtype: str) -> list[float]:
    with Engine(model_path, tp_size=tp, dtype=dtype, max_total_tokens=8192) as eng:
        vocab = min(eng.model_config.vocab_size, 256)
        rng = random.Random(0)
        prompts = [[rng.randrange(vocab) for _ in range(64)] for _ in range(batch)]
        params = {"max_new_tokens": steps, "temperature": 0.0, "ignore_eos": True}
        eng.generate(input_ids=prompts, sampling_params=params)  # warm-up
        eng.scheduler.stats.step_log.clear()
        eng.generate(input_ids=prompts, sampling_params=params)
        return [s for mode, bs, _, s in eng.scheduler.stats.step_log if mode == "DECODE" and bs == batch]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="default: the bundled SmolLM2 (tp 1 or 3)")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 3])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--dtype", default="float32")
    ns = p.parse_args()
    for batch in ns.batch:
        for tp in ns.tp:
            t = decode_steps(ns.model_path, tp, batch, ns.steps, ns.dtype)
            print(f"batch {batch:3d}  tp {tp}: decode step median {statistics.median(t) * 1e3:7.2f} ms, "
                  f"min {min(t) * 1e3:7.2f} ms  ({len(t)} steps)", flush=True)


if __name__ == "__main__":
    main()
