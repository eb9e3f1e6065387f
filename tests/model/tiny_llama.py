"""A tiny Llama-shaped checkpoint with random weights, written as a Hugging Face directory
(config.json, model.safetensors, a byte-level tokenizer.json): loads in well under a second, so
tests that start several processes (tensor parallelism, the server) stay fast."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

EOS = "<|endoftext|>"


def make_tiny_llama(
    directory: str,
    *,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    layers: int = 2,
    intermediate: int = 151,
    tie_word_embeddings: bool = False,
    vocab: int = 257,
    seed: int = 0,
) -> str:
    """Write the checkpoint into ``directory`` and return it.

    The vocabulary is the 256 bytes plus one end-of-text token (257: not a multiple of 2, so a
    tensor-parallel vocabulary split pads), the intermediate size odd (an uneven MLP split). The
    weights are scaled so that logits have clear winners: greedy tokens do not hinge on rounding.
    A larger ``vocab`` (benchmarks at a real model's size) has ids the tokenizer never produces."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    head_dim = hidden // heads
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int, scale: float | None = None) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * (scale if scale is not None else shape[-1] ** -0.5)

    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": w(vocab, hidden, scale=1.0),
                                   "model.norm.weight": 1 + 0.1 * w(hidden, scale=1.0)}
    if not tie_word_embeddings:
        sd["lm_head.weight"] = w(vocab, hidden, scale=0.5)
    for i in range(layers):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = w(heads * head_dim, hidden)
        sd[p + "self_attn.k_proj.weight"] = w(kv_heads * head_dim, hidden)
        sd[p + "self_attn.v_proj.weight"] = w(kv_heads * head_dim, hidden)
        sd[p + "self_attn.o_proj.weight"] = w(hidden, heads * head_dim)
        sd[p + "mlp.gate_proj.weight"] = w(intermediate, hidden)
        sd[p + "mlp.up_proj.weight"] = w(intermediate, hidden)
        sd[p + "mlp.down_proj.weight"] = w(hidden, intermediate)
        sd[p + "input_layernorm.weight"] = 1 + 0.1 * w(hidden, scale=1.0)
        sd[p + "post_attention_layernorm.weight"] = 1 + 0.1 * w(hidden, scale=1.0)
    save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(directory, "model.safetensors"))
    config: dict[str, Any] = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "num_hidden_layers": layers,
        "intermediate_size": intermediate, "vocab_size": vocab, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 512, "tie_word_embeddings": tie_word_embeddings, "eos_token_id": 256,
    }
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    _write_byte_tokenizer(directory)
    return directory


def _write_byte_tokenizer(directory: str) -> None:
    """Token id = byte value (no merges), plus the end-of-text token at 256."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from radixserve.model.gguf_tokenizer import bytes_to_unicode

    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # type: ignore[assignment]
    tok.decoder = decoders.ByteLevel()  # type: ignore[assignment]
    tok.add_special_tokens([EOS])
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": EOS, "add_bos_token": False}, f)
