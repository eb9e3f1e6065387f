"""Speculative decoding against plain decoding on the same engine, runs alternated (off, on, off,
on, ...), single stream, greedy: time per output token after the first, the ratio, and the
acceptance. Or, with ``--servers``, the same prompts against running OpenAI-compatible servers in
turn (radixserve with and without speculation, llama.cpp's llama-server with and without its own):
TPOT there is (time of the whole answer - time to one token) / (tokens - 1), from non-streaming
requests, which any server answers alike.

Workloads: ``grounded`` asks the model to copy, list or restate parts of a shipped text (the
n-grams of the answer are in the prompt: where speculation pays); ``chat`` asks open questions
(little to match: speculation must cost nothing there); ``lists`` asks to copy lists whose items
start alike (draft trees). Prints one line per run and a summary.

    python scripts/bench_spec.py --rounds 2 --max-new-tokens 160
    python scripts/bench_spec.py --algorithms draft --quantization none
    python scripts/bench_spec.py --servers off=http://127.0.0.1:30000 ngram=http://127.0.0.1:30001 \
        llama=http://127.0.0.1:8080 llama-spec=http://127.0.0.1:8081
"""

from __future__ import annotations

import argparse
import statistics
import time
from importlib.resources import files

from radixserve.engine import Engine
from radixserve.model.model_runner import ModelRunner
from radixserve.results import write_result

TEXT = files("radixserve.bench").joinpath("data/grounded.txt").read_text()
GROUNDED = ["Copy the second paragraph of the text word for word.",
            "List every year the text mentions, each with the sentence it appears in, quoted exactly.",
            "Rewrite the first paragraph, keeping every sentence but changing 'town' to 'village'."]
# lists whose items start alike: after a shared opening several continuations are in the prompt
# (where draft trees pay: ``--speculative-ngram-max-bfs-breadth``)
LISTS = ["Copy this list exactly:\n" + "\n".join(f"- the old red {w} by the {p}" for w, p in (
             ("house", "sea"), ("car", "road"), ("door", "gate"), ("boat", "pier"), ("gate", "wall"), ("barn", "field"))),
         "Repeat these settings, one per line:\n" + "\n".join(f"set the {k} limit to {v} for the {s} queue" for k, v, s in (
             ("memory", "4 GB", "batch"), ("time", "30 s", "interactive"), ("memory", "8 GB", "training"),
             ("time", "2 h", "batch"), ("retry", "3", "interactive"))),
         "Copy these lines of code:\n" + "\n".join(f"    self.{n} = config.get(\"{n}\", {d})" for n, d in (
             ("max_batch", "32"), ("max_tokens", "4096"), ("max_retries", "3"), ("min_batch", "1"), ("min_tokens", "16")))]
CHAT = ["Write a short story about a robot who learns to paint.",
        "Explain why the sky is blue to a ten-year-old.",
        "Give me five ideas for a birthday party for a book lover."]


def prompts(engine: Engine, workload: str) -> list[str]:
    return [engine.apply_chat_template(m) for m in messages(workload)]


def run(runner: ModelRunner, workload: str, algorithm: str | None, max_new: int) -> tuple[float, dict]:
    kw: dict[str, object] = {"speculative_algorithm": algorithm} if algorithm else {}
    if algorithm == "ngram-chain":  # n-gram drafts without trees (one match per step)
        kw = {"speculative_algorithm": "ngram", "speculative_ngram_max_bfs_breadth": 1}
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


def messages(workload: str) -> list[list[dict[str, str]]]:
    if workload == "grounded":
        return [[{"role": "user", "content": f"Here is a text:\n\n{TEXT}\n\n{q}"}] for q in GROUNDED]
    return [[{"role": "user", "content": q}] for q in (LISTS if workload == "lists" else CHAT)]


def server_tpot(url: str, workload: str, max_new: int) -> float:
    """Mean TPOT of the workload's prompts against an OpenAI-compatible server."""
    import httpx

    tpots = []
    with httpx.Client(base_url=url, timeout=600) as c:
        def ask(m: list[dict[str, str]], n: int) -> tuple[float, int]:
            t0 = time.perf_counter()
            r = c.post("/v1/chat/completions", json={"model": "default", "messages": m, "max_tokens": n,
                                                     "temperature": 0})
            r.raise_for_status()
            return time.perf_counter() - t0, int(r.json()["usage"]["completion_tokens"])
        for m in messages(workload):
            ask(m, 1)  # the prompt is then cached alike for the two timed requests
            first, _ = ask(m, 1)
            total, n = ask(m, max_new)
            tpots.append((total - first) / max(n - 1, 1))
    return statistics.mean(tpots)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="a GGUF file or model directory (default: the bundled model)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="auto", help="the target's --quantization (none: float weights, "
                    "which the draft algorithm drafts for with the file's blocks)")
    ap.add_argument("--algorithms", nargs="+", default=["ngram"], choices=["ngram", "ngram-chain", "draft"],
                    help="ngram-chain: ngram with --speculative-ngram-max-bfs-breadth 1 (no draft trees)")
    ap.add_argument("--workloads", nargs="+", default=["grounded", "chat"], choices=["grounded", "chat", "lists"],
                    help="lists: copy lists whose items start alike (where draft trees pay)")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each setting per workload, alternated")
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--servers", nargs="+", metavar="LABEL=URL",
                    help="measure these running servers in turn instead of in-process engines")
    ap.add_argument("--output", help="also write the figures here as JSON (radixserve/results.py)")
    a = ap.parse_args()
    results: list[dict[str, object]] = []
    if a.servers:
        servers = [tuple(s.split("=", 1)) for s in a.servers]
        for w in a.workloads:
            got: dict[str, list[float]] = {}
            for r in range(a.rounds):
                for label, url in servers:
                    tpot = server_tpot(url, w, a.max_new_tokens)
                    got.setdefault(label, []).append(tpot)
                    results.append({"workload": w, "round": r + 1, "server": label, "tpot_ms": round(tpot * 1e3, 2)})
                    print(f"{w:9s} round {r + 1} {label:12s} TPOT {tpot * 1e3:6.1f} ms", flush=True)
            print(f"{w:9s} TPOT medians: " + ", ".join(f"{k} {statistics.median(v) * 1e3:.1f} ms" for k, v in got.items()))
        if a.output:
            write_result(a.output, {"results": results})
        return
    runner = ModelRunner(a.model_path, dtype=a.dtype, quantization=a.quantization, progress=False)
    print(f"model {a.model_path or 'bundled SmolLM2-135M Q4_1'}, dtype {runner.dtype}, "
          f"quantization {runner.quantization}, single stream, greedy")
    settings: list[str | None] = [None, *a.algorithms]
    for w in a.workloads:
        got2: dict[str | None, list[float]] = {}
        for r in range(a.rounds):
            for algo in settings:
                tpot, meta = run(runner, w, algo, a.max_new_tokens)
                got2.setdefault(algo, []).append(tpot)
                results.append({"workload": w, "round": r + 1, "speculation": algo or "off",
                                "dtype": str(runner.dtype), "quantization": runner.quantization,
                                "tpot_ms": round(tpot * 1e3, 2), **meta})
                acc = ""
                if algo and meta["spec_verify_ct"]:
                    acc = (f"  verify steps {meta['spec_verify_ct']}, accepted {meta['spec_accepted_tokens']}, "
                           f"{(meta['spec_verify_ct'] + meta['spec_accepted_tokens']) / meta['spec_verify_ct']:.2f} tokens/verify")
                print(f"{w:9s} round {r + 1} speculation {algo or 'off':5s}  TPOT {tpot * 1e3:6.1f} ms{acc}", flush=True)
        off = statistics.median(got2[None])
        for algo in a.algorithms:
            on = statistics.median(got2[algo])
            print(f"{w:9s} TPOT {algo}/off (medians) {on * 1e3:.1f} / {off * 1e3:.1f} ms = {on / off:.2f}x")
    if a.output:
        write_result(a.output, {"results": results})


if __name__ == "__main__":
    main()
