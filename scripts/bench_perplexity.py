"""Perplexity of each GGUF quantization type, radixserve against llama.cpp's ``llama-perplexity``.

For each type the bundled SmolLM2 is requantized with ``llama-quantize`` (real weights in that
type; both programs read the same file), then both compute the perplexity of the same shipped
text the way ``llama-perplexity`` does: the text's tokens cut into chunks of ``--ctx`` tokens (the
first replaced by BOS where the model adds one), each chunk evaluated on its own, and the
negative log-likelihood taken over each chunk's second half (the first half is context). Ours
runs through ``Engine`` (prompt logprobs: the prefill path, the GGUF blocks read in place).

    bin=$(bash ../shared/tools/build_llama_server.sh | tail -1)
    python scripts/bench_perplexity.py --llama-bin-dir "$(dirname "$bin")" --output ppl.json

Prints one line per type: both perplexities and their ratio.
"""

from __future__ import annotations

import argparse
import math
import re
import subprocess
import tempfile
from pathlib import Path

from radixserve.bench.quant_quality import shipped_text
from radixserve.engine import Engine
from radixserve.model.loader import default_model_path
from radixserve.model.model_runner import ModelRunner
from radixserve.results import write_result

# llama-quantize's names; the K types in their _S mixes (mostly the type itself)
TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K_S", "Q4_K_S", "Q5_K_S", "Q6_K", "IQ4_NL", "IQ4_XS",
         "Q4_K_M", "Q5_K_M"]


def llama_ppl(bin_dir: Path, model: Path, text_file: Path, ctx: int, threads: int) -> float:
    out = subprocess.run([str(bin_dir / "llama-perplexity"), "-m", str(model), "-f", str(text_file), "-c", str(ctx),
                          "-b", str(ctx), "-t", str(threads)], capture_output=True, text=True, check=True)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
    if found is None:
        raise RuntimeError(f"llama-perplexity printed no estimate:\n{out.stderr[-2000:]}")
    return float(found.group(1))


def our_ppl(model: Path, text: str, ctx: int, dtype: str) -> tuple[float, int]:
    """The perplexity and the number of positions it is taken over."""
    runner = ModelRunner(str(model), dtype=dtype, progress=False)
    engine = Engine(runner=runner, max_total_tokens=4 * ctx, context_length=2 * ctx)
    try:
        tok = runner.tokenizer
        ids = tok.encode(text)
        first = ctx // 2
        nll, count = 0.0, 0
        for c in range(len(ids) // ctx):
            chunk = list(ids[c * ctx : (c + 1) * ctx])
            if tok.add_bos_token and tok.bos_token_id is not None:
                chunk[0] = tok.bos_token_id
            out = engine.generate(input_ids=chunk, sampling_params={"max_new_tokens": 1, "temperature": 0.0},
                                  logprob_start_len=first + 1)
            lps = out["meta_info"]["input_token_logprobs"]  # tokens first + 1 .. ctx - 1
            nll -= sum(lps)
            count += len(lps)
        engine.check_memory_invariant()
        return math.exp(nll / count), count
    finally:
        engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bin-dir", type=Path, default=Path.home() / ".cache/llama.cpp-server/build/bin",
                    help="where llama-quantize and llama-perplexity are (../shared/tools/build_llama_server.sh)")
    ap.add_argument("--types", nargs="+", default=TYPES, help="llama-quantize type names")
    ap.add_argument("--ctx", type=int, default=128, help="tokens per chunk (llama-perplexity -c)")
    ap.add_argument("--dtypes", nargs="+", default=["auto", "float32"], help="radixserve --dtype values to run")
    ap.add_argument("--threads", type=int, default=2, help="llama-perplexity -t")
    ap.add_argument("--output", help="also write the figures here as JSON (radixserve/results.py)")
    a = ap.parse_args()
    src = Path(default_model_path())
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        text_file = Path(tmp) / "text.txt"
        text = shipped_text()
        text_file.write_text(text)
        for qtype in a.types:
            model = Path(tmp) / f"smollm2-{qtype}.gguf"
            subprocess.run([str(a.llama_bin_dir / "llama-quantize"), "--allow-requantize", str(src), str(model), qtype],
                           capture_output=True, check=True)
            ref = llama_ppl(a.llama_bin_dir, model, text_file, a.ctx, a.threads)
            row: dict[str, object] = {"type": qtype, "ctx": a.ctx, "llama_ppl": round(ref, 4)}
            line = f"{qtype:7s} llama.cpp {ref:8.4f}"
            for dtype in a.dtypes:
                ours, positions = our_ppl(model, text, a.ctx, dtype)
                row["positions"] = positions
                row[f"ppl_{dtype}"] = round(ours, 4)
                row[f"ratio_{dtype}"] = round(ours / ref, 4)
                line += f"  ours ({dtype}) {ours:8.4f} = {ours / ref:.4f}x"
            results.append(row)
            print(line, flush=True)
            model.unlink()
    if a.output:
        write_result(a.output, {"results": results})


if __name__ == "__main__":
    main()
