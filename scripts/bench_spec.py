"""Speculative decoding against plain decoding on the same engine, runs alternated (off, on, off,
on, ...), single stream, greedy: time per output token after the first, the ratio, and the
acceptance.

Workloads: ``grounded`` asks the model to copy, list or restate parts of a shipped text (the
n-grams of the answer are in the prompt: where speculation pays); ``chat`` asks open questions
(little to match: speculation must cost nothing there). Prints one line per run and a summary.

    python scripts/bench_spec.py --rounds 2 --max-new-tokens 160
"""

from __future__ import annotations

import argparse
import statistics
import time
from importlib.resources import files

from radixserve.engine import Engine
from radixserve.model.model_runner import ModelRunner

TEXT = files("radixserve.bench").joinpath("data/grounded.txt").read_text()
GROUNDED = ["Copy the second paragraph of the text word for word.",
            "List every year the text mentions, each with the sentence it appears in, quoted exactly.",
            "Rewrite the first paragraph, keeping every sentence but changing 'town' to 'village'."]
CHAT = ["Write a short story about a robot who learns to paint.",
        "Explain why the sky is blue to a ten-year-old.",
        "Give me five ideas for a birthday party for a book lover."]


def prompts(engine: Engine, workload: str) -> list[str]:
    if workload == "grounded":
        msgs = [[{"role": "user", "content": f"Here is a text:\n\n{TEXT}\n\n{q}"}] for q in GROUNDED]
    else:
        msgs = [[{"role": "user", "content": q}] for q in CHAT]
    return [engine.apply_chat_template(m) for m in msgs]


def run(runner: ModelRunner, workload: str, spec: bool, max_new: int) -> tuple[float, dict]:
    kw = {"speculative_algorithm": "ngram"} if spec else {}
    engine = Engine(runner=runner, max_total_tokens=8192, context_length=4096, **kw)
    try:
        tpots, meta = [], {"spec_verify_ct": 0, "spec_accepted_tokens": 0}
        engine.generate("Hello", {"max_new_tokens": 4})
        for p in prompts(engine, workload):
            first = None
            n = 0
            for chunk in engine.generate_stream(p, {"temperature": 0.0, "max_new_tokens": max_new}):
                n += len(chunk["output_ids"])
                if first is None and n:
                    first = time.perf_counter()
                last = chunk
            assert first is not None
            tpots.append((time.perf_counter() - first) / max(n - 1, 1))
            for k in meta:
                meta[k] += last["meta_info"].get(k, 0)
        engine.check_memory_invariant()
        return statistics.mean(tpots), meta
    finally:
        engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="a GGUF file or model directory (default: the bundled model)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--workloads", nargs="+", default=["grounded", "chat"], choices=["grounded", "chat"])
    ap.add_argument("--rounds", type=int, default=2, help="off/on pairs per workload")
    ap.add_argument("--max-new-tokens", type=int, default=160)
    a = ap.parse_args()
    runner = ModelRunner(a.model_path, dtype=a.dtype, progress=False)
    print(f"model {a.model_path or 'bundled SmolLM2-135M Q4_1'}, dtype {runner.dtype}, single stream, greedy")
    for w in a.workloads:
        off, on = [], []
        for r in range(a.rounds):
            for spec in (False, True):
                tpot, meta = run(runner, w, spec, a.max_new_tokens)
                (on if spec else off).append(tpot)
                acc = ""
                if spec and meta["spec_verify_ct"]:
                    acc = (f"  verify steps {meta['spec_verify_ct']}, accepted {meta['spec_accepted_tokens']}, "
                           f"{(meta['spec_verify_ct'] + meta['spec_accepted_tokens']) / meta['spec_verify_ct']:.2f} tokens/verify")
                print(f"{w:9s} round {r + 1} speculation {'on ' if spec else 'off'}  TPOT {tpot * 1e3:6.1f} ms{acc}")
        ratio = statistics.median(on) / statistics.median(off)
        print(f"{w:9s} TPOT on/off (medians) {statistics.median(on) * 1e3:.1f} / {statistics.median(off) * 1e3:.1f} ms"
              f" = {ratio:.2f}x")


if __name__ == "__main__":
    main()
