#!/usr/bin/env python
"""A GGUF model of a chosen size with random quantized weights, for speed and memory benchmarks
(``radixserve bench model``) where no real model of that size can be downloaded.

    python scripts/make_random_gguf.py /tmp/llama-1b-q4_k_m.gguf                 # ~1.1B Llama, Q4_K_M mix
    python scripts/make_random_gguf.py /tmp/qwen3moe-1b.gguf --arch qwen3moe     # ~1B, 8 experts, top 2
    python scripts/make_random_gguf.py /tmp/gemma3-1b.gguf --arch gemma3         # Gemma 3 1B's shape

The tokenizer, chat template and special tokens are the bundled SmolLM2's (so both servers load and
tokenize it alike); the matrices are random blocks with scales chosen so activations stay near 1
(nothing here is meant to produce text). The mix is Q4_K_M's: Q4_K matrices, ``attn_v`` and
``ffn_down`` in Q6_K, the embedding in Q8_0 and tied to the output; norms F32. Shapes default to
Llama-3.2-1B's (hidden 2048, 16 layers, 32 / 8 heads, FFN 8192) and, for ``qwen3moe``, to a
Qwen3-MoE cut down to ~1B total (hidden 1024, 16 layers, 8 experts of FFN 2048, top 2), for
``gemma3`` to Gemma 3 1B's (hidden 1152, 26 layers, 4 / 1 heads of 256, FFN 6912, five local
layers with a window of 512 to one global).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# byte offsets of each block's float16 scales, and the scale that keeps a weight near 1/sqrt(K)
SCALES = {"Q4_K": ([0, 2], 2e-5), "Q6_K": ([208], 5e-6), "Q8_0": ([0], 1.5e-4)}
TOKENIZER_KEYS = ("tokenizer.", "general.name")


def random_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator, scale: float = 1.0) -> Any:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    qtype = GGMLQuantizationType[kind]
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    offsets, base = SCALES[kind]
    for off in offsets:
        d = (np.abs(rng.standard_normal(len(raw))) * base * scale + base * scale * 0.5).astype(np.float16)
        raw[:, off : off + 2] = d.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1), qtype


def copy_tokenizer(w: Any, source: str) -> None:
    """Every ``tokenizer.*`` field of ``source`` into the writer, as it is."""
    from gguf import GGUFReader, GGUFValueType

    r = GGUFReader(source)
    for key, f in r.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = f.types[0]
        if kind == GGUFValueType.ARRAY:
            sub = f.types[1]
            if sub == GGUFValueType.STRING:
                w.add_array(key, [bytes(f.parts[i]).decode("utf-8") for i in f.data])
            else:
                w.add_array(key, [f.parts[i].tolist()[0] for i in f.data])
        elif kind == GGUFValueType.STRING:
            w.add_string(key, bytes(f.parts[f.data[0]]).decode("utf-8"))
        elif kind == GGUFValueType.BOOL:
            w.add_bool(key, bool(f.parts[f.data[0]][0]))
        else:
            w.add_uint32(key, int(f.parts[f.data[0]][0]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("output")
    ap.add_argument("--arch", default="llama", choices=["llama", "qwen3moe", "gemma3"])
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--window", type=int, default=512, help="gemma3: the local layers' sliding window.")
    ap.add_argument("--ffn", type=int, default=None, help="FFN width (per expert for qwen3moe).")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--experts-used", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    import gguf
    from tqdm import tqdm

    from radixserve.model.loader import default_model_path

    moe, gemma = args.arch == "qwen3moe", args.arch == "gemma3"
    hidden = args.hidden or (1024 if moe else 1152 if gemma else 2048)
    heads = args.heads or (16 if moe else 4 if gemma else 32)
    ffn = args.ffn or (2048 if moe else 6912 if gemma else 8192)
    head_dim = 128 if moe else 256 if gemma else hidden // heads
    args.layers = args.layers or (26 if gemma else 16)
    args.kv_heads = args.kv_heads or (1 if gemma else 8)
    src = default_model_path()
    vocab = len(gguf.GGUFReader(src).fields["tokenizer.ggml.tokens"].data)
    rng = np.random.default_rng(args.seed)

    w = gguf.GGUFWriter(args.output, args.arch)
    w.add_name(f"random {args.arch} {hidden}x{args.layers}")
    w.add_block_count(args.layers)
    w.add_context_length(8192)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(args.kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    if gemma:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_sliding_window(args.window)
    if moe:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_expert_count(args.experts)
        w.add_expert_used_count(args.experts_used)
        w.add_expert_feed_forward_length(ffn)
    else:
        w.add_rope_dimension_count(head_dim)
    copy_tokenizer(w, src)

    def put(name: str, kind: str, rows: int, cols: int, stack: int = 0, scale: float = 1.0) -> None:
        if kind == "F32":
            w.add_tensor(name, np.ones(cols, dtype=np.float32))
            return
        if kind.endswith("_K") and cols % 256:  # rows that K-quant blocks do not tile: Q8_0, as llama.cpp falls back
            kind = "Q8_0"
        n = max(stack, 1)
        raw, qtype = random_blocks(kind, rows * n, cols, rng, scale)
        w.add_tensor(name, raw.reshape(n, rows, -1) if stack else raw, raw_dtype=qtype)

    put("token_embd.weight", "Q8_0", vocab, hidden, scale=50.0)  # looked up: values near 1
    put("output_norm.weight", "F32", 1, hidden)
    q_out, kv_out = heads * head_dim, args.kv_heads * head_dim
    for i in tqdm(range(args.layers), desc="layers"):
        p = f"blk.{i}."
        put(p + "attn_norm.weight", "F32", 1, hidden)
        put(p + "ffn_norm.weight", "F32", 1, hidden)
        put(p + "attn_q.weight", "Q4_K", q_out, hidden)
        put(p + "attn_k.weight", "Q4_K", kv_out, hidden)
        put(p + "attn_v.weight", "Q6_K" if i % 2 == 0 else "Q4_K", kv_out, hidden)
        put(p + "attn_output.weight", "Q4_K", hidden, q_out)
        down = "Q6_K" if i % 2 == 0 else "Q4_K"
        if gemma:
            for norm in ("attn_q_norm", "attn_k_norm"):
                put(p + norm + ".weight", "F32", 1, head_dim)
            for norm in ("post_attention_norm", "post_ffw_norm"):
                put(p + norm + ".weight", "F32", 1, hidden)
        if moe:
            put(p + "attn_q_norm.weight", "F32", 1, head_dim)
            put(p + "attn_k_norm.weight", "F32", 1, head_dim)
            w.add_tensor(p + "ffn_gate_inp.weight", (rng.standard_normal((args.experts, hidden)) * 0.02).astype(np.float32))
            put(p + "ffn_gate_exps.weight", "Q4_K", ffn, hidden, stack=args.experts)
            put(p + "ffn_up_exps.weight", "Q4_K", ffn, hidden, stack=args.experts)
            put(p + "ffn_down_exps.weight", down, hidden, ffn, stack=args.experts)
        else:
            put(p + "ffn_gate.weight", "Q4_K", ffn, hidden)
            put(p + "ffn_up.weight", "Q4_K", ffn, hidden)
            put(p + "ffn_down.weight", down, hidden, ffn)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=True)
    w.close()
    print(args.output)


if __name__ == "__main__":
    main()
