"""Tiny random-weight checkpoints of every model family the engine runs, made with transformers'
own classes (``from_config``) so that their config.json and tensor names are exactly what a user's
download holds, and the same weights written as a GGUF file in llama.cpp's names and layout.

Weights are redrawn at the scale tiny_llama uses (logits with clear winners: greedy tokens do not
hinge on rounding). The tokenizer is tiny_llama's byte tokenizer: id = byte, 256 = end of text.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import torch

from tests.model.tiny_llama import EOS, _write_byte_tokenizer

_COMMON: dict[str, Any] = dict(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, vocab_size=257,
    max_position_embeddings=512, eos_token_id=256, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    # model_type, config overrides
    "mixtral": ("mixtral", dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)),
    # the second layer dense (mlp_only_layers), the chosen experts' weights not renormalized
    "qwen3_moe": ("qwen3_moe", dict(intermediate_size=80, moe_intermediate_size=40, num_experts=6,
                                    num_experts_per_tok=2, head_dim=16, mlp_only_layers=[1], norm_topk_prob=False,
                                    rms_norm_eps=1e-6)),
    # Phi-4-mini's shape: RoPE over 3/4 of each head, LongRoPE from 128 to 512 positions, tied head
    "phi3": ("phi3", dict(intermediate_size=96, original_max_position_embeddings=128, partial_rotary_factor=0.75,
                          tie_word_embeddings=True, pad_token_id=0,
                          rope_scaling={"rope_type": "longrope", "rope_theta": 10000.0,
                                        "short_factor": [1.0, 1.1, 1.2, 1.5, 2.0, 3.0],
                                        "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]})),
    # every Granite scalar away from 1, so that leaving one out shows
    "granite": ("granite", dict(intermediate_size=96, embedding_multiplier=3.0, residual_multiplier=0.5,
                                attention_multiplier=0.2, logits_scaling=4.0)),
    "olmo2": ("olmo2", dict(intermediate_size=96, pad_token_id=0)),
    # a window on every layer (Mistral 7B v0.1's kind), 8 positions: the tests' sequences run past it
    "mistral": ("mistral", dict(intermediate_size=96, sliding_window=8)),
    # windows of 8 positions (the tests' sequences run past them), a score scale that is not
    # head_dim's, caps low enough to bite
    "gemma2": ("gemma2", dict(intermediate_size=96, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
                              attn_logit_softcapping=5.0, final_logit_softcapping=10.0, pad_token_id=0,
                              tie_word_embeddings=True)),
    # one local and one global layer, each with its own RoPE (the global one linearly scaled)
    "gemma3": ("gemma3_text", dict(intermediate_size=96, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
                                   pad_token_id=0, tie_word_embeddings=True,
                                   layer_types=["sliding_attention", "full_attention"],
                                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                    "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                       "rope_theta": 1000000.0}})),
}


def make_tiny_model(directory: str, family: str, seed: int = 0, vocab_size: int = 257) -> str:
    """Write a ``family`` checkpoint (a key of FAMILIES) into ``directory``; returns it. A
    ``vocab_size`` past 257 has ids the byte tokenizer never produces (for a GGUF file given
    another tokenizer)."""
    import transformers

    model_type, overrides = FAMILIES[family]
    config = transformers.AutoConfig.for_model(model_type, **{**_COMMON, **overrides, "vocab_size": vocab_size})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norms
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory)
    _write_byte_tokenizer(directory)
    return directory


def write_gguf(hf_dir: str, path: str, tokenizer: dict[str, Any] | None = None,
               blocks: Any = None) -> str:
    """The checkpoint at ``hf_dir`` as a float32 GGUF file, laid out as llama.cpp's converter lays
    it out: its tensor names, q/k rows permuted for the llama architecture, experts stacked into one
    tensor per projection, Phi-3's q/k/v and gate/up fused, LongRoPE factors as tensors.
    ``tokenizer``: ``tokenizer.ggml.*`` metadata to write instead of the byte tokenizer's.
    ``blocks(name, float32 array)``: ``(uint8 blocks, GGMLQuantizationType)`` to store instead of a
    tensor, or None to keep it float32."""
    import gguf
    from safetensors.torch import load_file

    from radixserve.model.config import ModelConfig

    with open(os.path.join(hf_dir, "config.json")) as f:
        hf = json.load(f)
    c = ModelConfig.from_hf_dict(hf)
    sd = load_file(os.path.join(hf_dir, "model.safetensors"))
    arch = c.arch
    w = gguf.GGUFWriter(path, arch)
    _write_hparams(w, c)
    _write_tokenizer(w, tokenizer)

    def put(name: str, t: torch.Tensor) -> None:
        if c.norm_weight_offset and name.endswith("norm.weight"):  # llama.cpp stores Gemma's norms as 1 + w
            t = t + c.norm_weight_offset
        arr = t.float().contiguous().numpy()
        q = blocks(name, arr) if blocks is not None and arr.ndim >= 2 else None
        if q is None:
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, q[0], raw_dtype=q[1])

    put("token_embd.weight", sd["model.embed_tokens.weight"])
    put("output_norm.weight", sd["model.norm.weight"])
    if "lm_head.weight" in sd and not c.tie_word_embeddings:
        put("output.weight", sd["lm_head.weight"])
    for i in range(c.num_layers):
        _write_layer(put, sd, c, i)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _write_hparams(w: Any, c: Any) -> None:
    import gguf

    arch = c.arch
    w.add_block_count(c.num_layers)
    w.add_context_length(c.max_position)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_dimension_count(c.rotary_dim)
    w.add_layer_norm_rms_eps(c.rms_eps)
    w.add_rope_freq_base(c.rope_theta)
    sc = c.rope_scaling or {}
    if arch in ("gemma2", "gemma3"):
        w.add_sliding_window(c.sliding_window)
        w.add_sliding_window_pattern([i in c.sliding_layers for i in range(c.num_layers)])
        if c.attn_softcap:
            w.add_attn_logit_softcapping(c.attn_softcap)
        if c.final_softcap:
            w.add_final_logit_softcapping(c.final_softcap)
        w.add_attention_scale(c.attention_multiplier or c.head_dim**-0.5)
        if sc.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(sc["factor"])
    elif c.sliding_window:  # a window on every layer (Mistral)
        w.add_sliding_window(c.sliding_window)
    if arch == "granite":
        w.add_embedding_scale(c.embedding_multiplier)
        w.add_residual_scale(c.residual_multiplier)
        w.add_attention_scale(c.attention_multiplier or c.head_dim**-0.5)
        w.add_logit_scale(c.logits_scaling)
    if c.num_experts:
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        if arch != "llama":
            w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_expert_weights_norm(c.norm_topk_prob)  # llama.cpp assumes true where the key is absent
    if sc.get("rope_type") == "longrope":
        w.add_uint32(f"{arch}.rope.scaling.original_context_length", sc["original_max_position_embeddings"])
        w.add_float32(f"{arch}.rope.scaling.attn_factor", sc["attention_factor"])
        w.add_tensor("rope_factors_long.weight", np.array(sc["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(sc["short_factor"], dtype=np.float32))


def _write_tokenizer(w: Any, tokenizer: dict[str, Any] | None) -> None:
    from radixserve.model.gguf_tokenizer import bytes_to_unicode

    if tokenizer is None:
        byte_map = bytes_to_unicode()
        w.add_tokenizer_model("gpt2")
        w.add_token_list([byte_map[b] for b in range(256)] + [EOS])
        w.add_token_types([1] * 256 + [3])
        w.add_eos_token_id(256)
    else:
        for key, value in tokenizer.items():
            if isinstance(value, list):
                w.add_array(key, value)
            elif isinstance(value, bool):
                w.add_bool(key, value)
            elif isinstance(value, int):
                w.add_uint32(key, value)
            else:
                w.add_string(key, value)


def _write_layer(put: Any, sd: dict[str, torch.Tensor], c: Any, i: int) -> None:
    """Layer ``i``'s tensors under llama.cpp's names."""
    from radixserve.model.gguf_loader import permute_qk

    arch = c.arch
    p, b = f"model.layers.{i}.", f"blk.{i}."
    if c.norm_layout == "sandwich":
        put(b + "attn_norm.weight", sd[p + "input_layernorm.weight"])
        put(b + "post_attention_norm.weight", sd[p + "post_attention_layernorm.weight"])
        put(b + "ffn_norm.weight", sd[p + "pre_feedforward_layernorm.weight"])
        put(b + "post_ffw_norm.weight", sd[p + "post_feedforward_layernorm.weight"])
    elif c.norm_layout == "post":
        put(b + "post_attention_norm.weight", sd[p + "post_attention_layernorm.weight"])
        put(b + "post_ffw_norm.weight", sd[p + "post_feedforward_layernorm.weight"])
    else:
        put(b + "attn_norm.weight", sd[p + "input_layernorm.weight"])
        put(b + "ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
    put(b + "attn_output.weight", sd[p + "self_attn.o_proj.weight"])
    if arch == "phi3":
        put(b + "attn_qkv.weight", sd[p + "self_attn.qkv_proj.weight"])
    else:
        q, k = sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"]
        if arch in ("llama", "granite"):
            q, k = permute_qk(q, c.num_heads), permute_qk(k, c.num_kv_heads)
        put(b + "attn_q.weight", q)
        put(b + "attn_k.weight", k)
        put(b + "attn_v.weight", sd[p + "self_attn.v_proj.weight"])
    if c.qk_norm:
        put(b + "attn_q_norm.weight", sd[p + "self_attn.q_norm.weight"])
        put(b + "attn_k_norm.weight", sd[p + "self_attn.k_norm.weight"])
    moe = "block_sparse_moe." if arch == "llama" and c.num_experts else "mlp."
    if c.is_moe_layer(i):
        names = {"w1": "gate", "w3": "up", "w2": "down"} if moe == "block_sparse_moe." else \
            {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
        put(b + "ffn_gate_inp.weight", sd[p + moe + "gate.weight"])
        for hf_name, g_name in names.items():
            stacked = torch.stack([sd[p + f"{moe}experts.{e}.{hf_name}.weight"] for e in range(c.num_experts)])
            put(b + f"ffn_{g_name}_exps.weight", stacked)
    elif arch == "phi3":
        put(b + "ffn_up.weight", sd[p + "mlp.gate_up_proj.weight"])
        put(b + "ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    else:
        for n in ("gate", "up", "down"):
            put(b + f"ffn_{n}.weight", sd[p + f"mlp.{n}_proj.weight"])
