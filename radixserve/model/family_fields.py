"""What model families read beyond Llama's fields: Gemma 2/3's (from an HF config and from a GGUF
file, as llama.cpp reads it) and the sliding windows of the other families' HF configs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def hf_windows(d: dict[str, Any], arch: str, num_layers: int) -> tuple[int | None, tuple[int, ...]]:
    """A (non-Gemma) HF config's sliding window and the layers it applies to: those ``layer_types``
    names, else Qwen2/3's layers from ``max_window_layers`` on (only with ``use_sliding_window``),
    else none named: every layer (Mistral, Phi-3; ``ModelRunner`` decides by the context)."""
    window = d.get("sliding_window")
    qwen = arch in ("qwen2", "qwen3", "qwen3moe")
    if not window or (qwen and not d.get("use_sliding_window", False)):
        return None, ()
    types = d.get("layer_types")
    if types:
        sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    elif qwen:
        sliding = tuple(range(int(d.get("max_window_layers", num_layers)), num_layers))
    else:
        return int(window), ()
    return (int(window), sliding) if sliding else (None, ())


def gemma_fields(
    d: dict[str, Any], arch: str, num_layers: int, theta: float, scaling: dict[str, Any] | None
) -> tuple[dict[str, Any], float, dict[str, Any] | None]:
    """Gemma 2 / 3's fields from an HF config, and the global layers' RoPE base and scaling (Gemma 3
    configs of transformers 5 give RoPE per layer type)."""
    types = d.get("layer_types")
    if not types:  # older configs: Gemma 2 alternates from a local layer, Gemma 3 has 5 local : 1 global
        pattern = int(d.get("sliding_window_pattern") or (2 if arch == "gemma2" else 6))
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]
    local_theta = d.get("rope_local_base_freq")
    params = d.get("rope_parameters") or {}
    if isinstance(params.get("full_attention"), dict):
        full = dict(params["full_attention"])
        theta = float(full.pop("rope_theta", theta))
        scaling = full if full.get("rope_type", "default") != "default" else None
        local_theta = (params.get("sliding_attention") or {}).get("rope_theta", local_theta)
    act = str(d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"Gemma with hidden_activation {act!r} is not supported (gelu_pytorch_tanh is)")
    qpas = d.get("query_pre_attn_scalar")
    fields = dict(
        norm_layout="sandwich",
        norm_weight_offset=1.0,
        hidden_act="gelu_tanh",
        embedding_multiplier=float(d["hidden_size"]) ** 0.5,
        attention_multiplier=float(qpas) ** -0.5 if qpas else None,
        attn_softcap=d.get("attn_logit_softcapping"),
        final_softcap=d.get("final_logit_softcapping"),
        sliding_layers=tuple(i for i, t in enumerate(types) if t == "sliding_attention"),
        local_rope_theta=float(local_theta) if arch == "gemma3" and local_theta else None,
        qk_norm=arch == "gemma3",
        tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
    )
    return fields, theta, scaling


def gguf_gemma_fields(arch: str, get: Callable[..., Any], layers: int, hidden: int, heads: int,
                       head_dim: int) -> dict[str, Any]:
    """Gemma 2 / 3 as llama.cpp reads their files: norms already hold 1 + w, sqrt(hidden) on the
    embeddings, local layers every ``pattern``, the 27B models' score scale from the hidden size,
    Gemma 3's local layers at RoPE base 10000 without scaling."""
    attn_scale = get("attention.scale")
    pattern = get("attention.sliding_window_pattern") or (2 if arch == "gemma2" else 6)
    if isinstance(pattern, list):  # one flag per layer: true = sliding
        sliding = tuple(i for i, flag in enumerate(pattern) if flag)
    else:
        sliding = tuple(i for i in range(layers) if i % int(pattern) < int(pattern) - 1)
    big = layers == (46 if arch == "gemma2" else 62)
    return dict(
        norm_layout="sandwich", hidden_act="gelu_tanh", embedding_multiplier=hidden**0.5,
        attention_multiplier=float(attn_scale) if attn_scale else (hidden / heads if big else head_dim) ** -0.5,
        attn_softcap=get("attn_logit_softcapping"), final_softcap=get("final_logit_softcapping"),
        sliding_layers=sliding,
        local_rope_theta=10000.0 if arch == "gemma3" else None, qk_norm=arch == "gemma3",
    )
