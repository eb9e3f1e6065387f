"""``radixserve bench chunking``: what a long prefill costs the requests already decoding.

A few short requests decode; then long prompts arrive, and their chunked prefill competes with
those decodes. The figure is the short requests' time per output token while the long prompts
are being prefilled (their inter-token gaps in that window), for each configuration: plain chunked
prefill, ``--enable-mixed-chunk``, ``--enable-dynamic-chunking`` and both. Configurations
alternate over ``--rounds`` on one loaded model (the machine drifts), and medians are printed.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from tqdm import tqdm

from radixserve.bench.workloads import random_workload
from radixserve.engine import Engine
from radixserve.sched.req import Req
from radixserve.sched.request_checks import check_request
from radixserve.sched.sampling_params import SamplingParams

CONFIGS: dict[str, dict[str, Any]] = {
    "chunked": {},
    "mixed": {"enable_mixed_chunk": True},
    "dynamic": {"enable_dynamic_chunking": True},
    "mixed+dynamic": {"enable_mixed_chunk": True, "enable_dynamic_chunking": True},
}


def probe(engine: Engine, num_short: int, long_len: int, num_long: int, seed: int) -> dict[str, float]:
    """One run: ``num_short`` 32-token prompts start decoding; after their 4th token ``num_long``
    prompts of ``long_len`` arrive. Returns the short requests' mean and max gap between tokens
    while a long prompt is still being prefilled, and the long prompts' mean TTFT."""
    sched = engine.scheduler
    short = random_workload(num_prompts=num_short, input_len=32, output_len=10_000, seed=seed)
    long = random_workload(num_prompts=num_long, input_len=long_len, output_len=4, seed=seed + 1)
    greedy = {"temperature": 0.0, "ignore_eos": True}
    shorts = [Req(f"s{i}", r.input_ids, SamplingParams.from_dict({**greedy, "max_new_tokens": 10_000}),
                  stream=True) for i, r in enumerate(short)]
    longs = [Req(f"l{i}", r.input_ids, SamplingParams.from_dict({**greedy, "max_new_tokens": 4}), stream=True)
             for i, r in enumerate(long)]
    for r in [*shorts, *longs]:  # what an engine's edge does: 10,000 new tokens clipped to the context
        err = check_request(r, sched.limits())
        if err is not None:
            raise ValueError(err.message)
    for r in shorts:
        sched.add_request(r)
    last: dict[str, float] = {}
    gaps: list[tuple[float, float, int]] = []  # (from, to, tokens) between two outputs of a short request
    arrived: float | None = None  # on the scheduler's clock
    step = sched.step_overlapped if sched.overlap_enabled() else sched.step
    while arrived is None or not all(r.finished() for r in longs):
        outs = step()
        now = sched.clock()
        for o in outs:
            if o.rid.startswith("s") and o.new_token_ids:
                if o.rid in last:
                    gaps.append((last[o.rid], now, len(o.new_token_ids)))
                last[o.rid] = now
        if arrived is None and all(len(r.output_ids) >= 4 for r in shorts):
            arrived = sched.clock()
            for r in longs:
                sched.add_request(r)
    for r in shorts:
        sched.abort_request(r.rid)
    while sched.has_work():
        step()
    assert arrived is not None
    firsts = [r.first_token_time for r in longs if r.first_token_time is not None]
    end = max(firsts)  # the last long prompt's first token: its prefill is over
    # the short requests' time per token over the gaps that overlap the prefill window
    window = [(t1 - t0) / n for t0, t1, n in gaps if t1 > arrived and t0 < end]
    return {"gap_ms_mean": statistics.mean(window) * 1e3 if window else float("nan"),
            "gap_ms_max": max(window) * 1e3 if window else float("nan"),
            "long_ttft_ms": statistics.mean(t - arrived for t in firsts) * 1e3}


def main(ns: argparse.Namespace) -> int:
    engine = Engine(ns.model_path, dtype=ns.dtype, chunked_prefill_size=ns.chunked_prefill_size,
                    dynamic_chunk_target_ms=ns.dynamic_chunk_target_ms)
    engine.generate(input_ids=list(range(1, 17)), sampling_params={"max_new_tokens": 2})  # warm-up
    settings = engine.scheduler.settings
    base = settings.args
    names = [n for n in ns.configs.split(",") if n]
    for n in names:
        if n not in CONFIGS:
            raise SystemExit(f"unknown configuration {n!r}; choose from {', '.join(CONFIGS)}")
    got: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    bar = tqdm(total=ns.rounds * len(names), desc="bench chunking", unit="run")
    for rnd in range(ns.rounds):
        for n in names:
            settings.args = base.replace(**CONFIGS[n])
            engine.flush_cache()
            got[n].append(probe(engine, ns.num_short, ns.long_len, ns.num_long, seed=rnd))
            bar.update(1)
    bar.close()
    settings.args = base
    print(f"\n{ns.num_short} decoding requests, {ns.num_long} prompts of {ns.long_len} tokens arriving, "
          f"--chunked-prefill-size {ns.chunked_prefill_size}, --dynamic-chunk-target-ms "
          f"{ns.dynamic_chunk_target_ms:g}; medians of {ns.rounds} alternated rounds")
    print(f"{'configuration':<16}{'TPOT during prefill ms':>24}{'max gap ms':>12}{'long TTFT ms':>14}")
    for n in names:
        med = {k: statistics.median(r[k] for r in got[n]) for k in got[n][0]}
        print(f"{n:<16}{med['gap_ms_mean']:>24.1f}{med['gap_ms_max']:>12.1f}{med['long_ttft_ms']:>14.1f}")
    return 0
