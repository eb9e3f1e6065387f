"""What each ``--kv-cache-dtype`` costs and buys: tokens per GiB, accuracy against the reference
format, and throughput, all in one run on one loaded model.

    python scripts/bench_kv_cache_dtype.py --output bench/results/<date-host>/bench-kv-cache-dtype.json

For each format (the first is the reference, bf16 by default):

- bytes per token of the KV pool and the tokens one GiB holds (ratio to the reference);
- perplexity of the shipped text (``quant_quality.shipped_text``, the method of
  ``bench_perplexity.py``: chunks of ``--ctx`` tokens, the NLL of each chunk's second half, through
  the engine's prompt logprobs: the prefill reads the stored KV);
- teacher-forced top-1 agreement with the reference format over the same positions (the share of
  positions whose most likely next token is the reference's: a greedy decode stays on its path
  while this holds), and free-running greedy agreement over ``--greedy-tokens`` tokens of a few
  prompts (the share of positions equal, and the first position that differs, per prompt);
- output and total throughput of ``--concurrency`` requests at once (random prompts of
  ``--input-len`` tokens, ``--output-len`` tokens each, ``ignore_eos``), and the median decode step
  with that many requests running; the formats' runs alternate, ``--rounds`` times.
"""

from __future__ import annotations

import argparse
import math
import statistics
from typing import Any

from radixserve.bench.offline import decode_step_ms, run_engine
from radixserve.bench.quant_quality import PASSAGES, shipped_text
from radixserve.bench.workloads import make_workload
from radixserve.engine import Engine
from radixserve.model.model_runner import ModelRunner
from radixserve.results import write_result


def accuracy(engine: Engine, ids: list[int], ctx: int, bos: int | None) -> tuple[float, list[int]]:
    """Perplexity over the chunks' second halves, and the most likely token at each of those positions."""
    nll, count, top1 = 0.0, 0, []
    first = ctx // 2
    for c in range(len(ids) // ctx):
        chunk = list(ids[c * ctx : (c + 1) * ctx])
        if bos is not None:
            chunk[0] = bos
        out = engine.generate(input_ids=chunk, logprob_start_len=first + 1,
                              sampling_params={"max_new_tokens": 1, "temperature": 0.0, "top_logprobs_num": 1})
        meta = out["meta_info"]
        nll -= sum(meta["input_token_logprobs"])
        count += len(meta["input_token_logprobs"])
        top1 += [t[0][0] for t in meta["input_top_logprobs"]]
    return math.exp(nll / count), top1


def greedy(engine: Engine, tokens: int) -> list[list[int]]:
    prompts = [p.split(". ")[0] + "." for p in PASSAGES]
    outs = engine.generate(prompts, {"max_new_tokens": tokens, "temperature": 0.0, "ignore_eos": True})
    return [o["output_ids"] for o in outs]


def throughput(engine: Engine, c: int, input_len: int, output_len: int) -> dict[str, float]:
    reqs = make_workload("random", num_prompts=c, input_len=input_len, output_len=output_len, seed=c)
    r = run_engine(engine, reqs, f"random-c{c}")
    step, _ = decode_step_ms(engine, c, input_len=input_len)
    engine.flush_cache()
    return {"output_tok_s": r.output_throughput, "total_tok_s": r.total_throughput, "decode_step_ms": step}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp8_e4m3", "fp8_e5m2", "int8"],
                    help="--kv-cache-dtype values; the first is the reference")
    ap.add_argument("--model-dtype", default="auto", help="the model's --dtype")
    ap.add_argument("--ctx", type=int, default=256, help="tokens per perplexity chunk")
    ap.add_argument("--greedy-tokens", type=int, default=64, help="tokens of each free-running greedy decode")
    ap.add_argument("--concurrency", type=int, nargs="*", default=[32, 128], help="requests at once (none: skip)")
    ap.add_argument("--input-len", type=int, default=512, help="prompt tokens of the throughput requests")
    ap.add_argument("--output-len", type=int, default=64, help="output tokens of the throughput requests")
    ap.add_argument("--rounds", type=int, default=1, help="throughput runs per format, alternated")
    ap.add_argument("--output", help="also write the figures here as JSON (radixserve/results.py)")
    a = ap.parse_args()
    runner = ModelRunner(None, dtype=a.model_dtype, progress=False)
    tok = runner.tokenizer
    ids = tok.encode(shipped_text())
    bos = tok.bos_token_id if tok.add_bos_token else None
    most = max(a.concurrency, default=1)
    pool_tokens = max(most * (a.input_len + a.output_len + 32), 4 * a.ctx)

    def engine(name: str, c: int | None = None) -> Engine:
        kw: dict[str, Any] = {"max_running_requests": c} if c else {}
        return Engine(runner=runner, max_total_tokens=pool_tokens, kv_cache_dtype=name, **kw)

    rows: dict[str, dict[str, Any]] = {}
    ref_top1: list[int] = []
    ref_greedy: list[list[int]] = []
    for name in a.dtypes:
        e = engine(name)
        try:
            bpt = runner.kv_bytes_per_token()
            ppl, top1 = accuracy(e, ids, a.ctx, bos)
            outs = greedy(e, a.greedy_tokens)
            e.check_memory_invariant()
        finally:
            e.shutdown()
        if not ref_top1:
            ref_top1, ref_greedy = top1, outs
        same = sum(x == y for r, o in zip(ref_greedy, outs, strict=True) for x, y in zip(r, o, strict=True))
        firsts = [next((i for i, (x, y) in enumerate(zip(r, o, strict=True)) if x != y), len(r))
                  for r, o in zip(ref_greedy, outs, strict=True)]
        rows[name] = {
            "kv_format": runner.kv_format.name, "bytes_per_token": bpt, "tokens_per_gib": (1 << 30) // bpt,
            "perplexity": round(ppl, 4), "positions": len(top1),
            "top1_agreement": round(sum(x == y for x, y in zip(ref_top1, top1, strict=True)) / len(top1), 4),
            "greedy_agreement": round(same / sum(len(r) for r in ref_greedy), 4), "greedy_first_diff": firsts,
        }
        print(f"{name:9s} {bpt:6d} B/token  {rows[name]['tokens_per_gib']:8d} tokens/GiB  ppl {ppl:.4f}  "
              f"top-1 agreement {rows[name]['top1_agreement']:.3f}  greedy agreement "
              f"{rows[name]['greedy_agreement']:.3f} (first difference {firsts})", flush=True)
    for c in a.concurrency:
        runs: dict[str, list[dict[str, float]]] = {n: [] for n in a.dtypes}
        for _ in range(a.rounds):
            for name in a.dtypes:
                e = engine(name, c)
                try:
                    runs[name].append(throughput(e, c, a.input_len, a.output_len))
                    e.check_memory_invariant()
                finally:
                    e.shutdown()
        ref = statistics.median(r["output_tok_s"] for r in runs[a.dtypes[0]])
        for name in a.dtypes:
            med = {k: statistics.median(r[k] for r in runs[name]) for k in runs[name][0]}
            rows[name][f"c{c}"] = {k: round(v, 2) for k, v in med.items()} | {"ratio": round(med["output_tok_s"] / ref, 3)}
            print(f"c{c:<4d} {name:9s} output {med['output_tok_s']:7.1f} tok/s ({med['output_tok_s'] / ref:.2f}x)  "
                  f"total {med['total_tok_s']:7.1f} tok/s  decode step {med['decode_step_ms']:.1f} ms", flush=True)
    ref_bpt = rows[a.dtypes[0]]["bytes_per_token"]
    for row in rows.values():
        row["tokens_vs_reference"] = round(ref_bpt / row["bytes_per_token"], 3)
    if a.output:
        write_result(a.output, {"model_dtype": str(runner.dtype), "ctx": a.ctx, "input_len": a.input_len,
                                "output_len": a.output_len, "rounds": a.rounds, "formats": rows})


if __name__ == "__main__":
    main()
