"""The architecture description every other model module reads.

One ``ModelConfig`` is built either from a GGUF file's metadata (llama.cpp key names) or from a
Hugging Face ``config.json``; ``to_hf_dict`` turns it back into a dict transformers accepts
(``LlamaConfig(**d)`` for Llama, ``AutoConfig.for_model(**d)`` for any), which the parity tests use.

The families differ from Llama in a few fields, and llama.py reads those fields, never the family:

- ``qwen2``: bias on q/k/v; ``qwen3``: RMSNorm on each head of q and k;
- ``qwen3moe`` (Qwen3-MoE) and ``llama`` with experts (Mixtral): routed experts in place of the MLP
  (``num_experts`` > 0), softmax over the router's logits, the top ``num_experts_per_tok``,
  renormalized where ``norm_topk_prob``;
- ``phi3`` (Phi-3, 3.5, 4-mini): q/k/v and gate/up fused in the checkpoint (the loaders split them),
  RoPE on the first ``rotary_dim`` dimensions only, LongRoPE scaling;
- ``granite`` (Granite 3): scalars on the embedding, each residual branch, the attention scores
  and the logits;
- ``olmo2`` (OLMo 2): a norm after attention and after the MLP instead of before, and q/k norms
  over the whole projection rather than per head;
- ``gemma2``, ``gemma3``: norms before and after each branch, norm weights stored as offsets from
  1, GELU, embeddings scaled by sqrt(hidden), sliding-window layers among global ones (Gemma 3's
  with their own RoPE base), soft-capped scores and logits (Gemma 2), q/k norms (Gemma 3).

Sliding windows: ``sliding_layers`` names the layers that attend over ``sliding_window`` (Gemma's
pattern, Qwen2's ``max_window_layers``); a window with no layers named is the whole model's (Mistral
7B v0.1, Phi-3), put on every layer by ``ModelRunner`` when the context is longer than it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from radixserve.model.family_fields import gemma_fields, gguf_gemma_fields, hf_windows

# GGUF ``general.architecture`` / HF ``model_type`` values this engine runs.
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe", "phi3", "granite", "olmo2", "gemma2", "gemma3")
_HF_ARCH_CLASS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "qwen3moe": "Qwen3MoeForCausalLM", "phi3": "Phi3ForCausalLM", "granite": "GraniteForCausalLM",
                  "olmo2": "Olmo2ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
# HF model_type -> our arch name (Mistral is a Llama, Mixtral a Llama with experts, as in llama.cpp)
_HF_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2",
                   "qwen3": "qwen3", "qwen3_moe": "qwen3moe", "phi3": "phi3", "granite": "granite", "olmo2": "olmo2",
                   "gemma2": "gemma2", "gemma3_text": "gemma3", "gemma3": "gemma3"}


@dataclass
class ModelConfig:
    arch: str  # one of SUPPORTED_ARCHS
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    max_position: int = 4096  # context length the model was trained for
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections (not o)
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k before RoPE
    rope_scaling: dict[str, Any] | None = None  # HF style, e.g. {"rope_type": "llama3", "factor": 8.0, ...}
    rope_freq_factors: list[float] | None = None  # GGUF ``rope_freqs`` tensor: divides each inv_freq
    rotary_dim: int = 0  # dimensions of each head RoPE rotates (the first ones); 0: all of them
    sliding_window: int | None = None  # attention span of a sliding-window model (ModelRunner limits the context)
    # routed experts (0: a dense MLP in every layer)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # the chosen experts' weights renormalized to sum to 1
    dense_layers: tuple[int, ...] = ()  # layers of an MoE model that keep a dense MLP
    # Granite's scalars: embeddings times, each branch's output times (before its residual add),
    # the attention scale (None: head_dim ** -0.5), logits divided by
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    # where each layer's norms are: "pre" (the inputs of attention and MLP), "post" (their outputs:
    # OLMo 2) or "sandwich" (both: Gemma)
    norm_layout: str = "pre"
    norm_weight_offset: float = 0.0  # added to every RMSNorm weight at load (Gemma stores w - 1)
    qk_norm_whole: bool = False  # OLMo 2: the q/k norms span the whole projection, not each head
    hidden_act: str = "silu"  # the MLP gate's activation: "silu" or "gelu_tanh"
    attn_softcap: float | None = None  # scores become cap * tanh(score / cap) (Gemma 2)
    final_softcap: float | None = None  # the same on the logits
    sliding_layers: tuple[int, ...] = ()  # layers attending over sliding_window only (Gemma)
    local_rope_theta: float | None = None  # those layers' RoPE base, without scaling (Gemma 3)
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    name: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHS:
            raise ValueError(f"unsupported architecture {self.arch!r}; supported: {SUPPORTED_ARCHS}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.rotary_dim == 0:
            self.rotary_dim = self.head_dim
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"rotary_dim {self.rotary_dim} must be even and at most head_dim {self.head_dim}")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} must be in 1..{self.num_experts}")
        self.dense_layers = tuple(self.dense_layers)
        self.sliding_layers = tuple(self.sliding_layers)
        if self.norm_layout not in ("pre", "post", "sandwich"):
            raise ValueError(f"norm_layout {self.norm_layout!r}: one of pre, post, sandwich")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise ValueError(f"hidden_act {self.hidden_act!r}: silu or gelu_tanh")
        if self.sliding_layers and not self.sliding_window:
            raise ValueError("sliding_layers without a sliding_window")

    # ------------------------------------------------------------------ derived sizes
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def whole_window(self) -> int | None:
        """The sliding window when every layer has it (no KV further behind a request's newest token
        is ever read again), else None."""
        return self.sliding_window if self.sliding_layers and len(self.sliding_layers) == self.num_layers else None

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> ModelConfig:
        """From a GGUF metadata dict (key -> python value), llama.cpp key names."""
        arch = str(meta["general.architecture"])
        if arch not in SUPPORTED_ARCHS:
            raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {SUPPORTED_ARCHS}")

        def get(key: str, default: Any = None) -> Any:
            return meta.get(f"{arch}.{key}", default)

        hidden = int(get("embedding_length"))
        heads = int(get("attention.head_count"))
        kv_heads = get("attention.head_count_kv", heads)
        if isinstance(kv_heads, list):  # per-layer lists exist in some files; all equal for these archs
            kv_heads = kv_heads[0]
        head_dim = int(get("attention.key_length", hidden // heads))
        tokens = meta.get("tokenizer.ggml.tokens")
        vocab = get("vocab_size")
        if vocab is None:
            vocab = len(tokens) if tokens is not None else None
        if vocab is None:
            raise ValueError("GGUF metadata gives no vocab size")
        rope_scaling = _gguf_rope_scaling(arch, get)
        experts = int(get("expert_count", 0) or 0)
        window = get("attention.sliding_window")
        attn_scale = get("attention.scale")
        layers = int(get("block_count"))
        gemma = gguf_gemma_fields(arch, get, layers, hidden, heads, head_dim) if arch in ("gemma2", "gemma3") else {}
        fields: dict[str, Any] = dict(
            arch=arch,
            num_layers=layers,
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(kv_heads),
            head_dim=head_dim,
            intermediate_size=int(get("feed_forward_length")),
            vocab_size=int(vocab),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            # GGUF stores eps as float32: round back to the decimal it was written from (1e-5, not 9.99e-6)
            rms_eps=float(f"{float(get('attention.layer_norm_rms_epsilon', 1e-5)):.6g}"),
            max_position=int(get("context_length", 4096)),
            tie_word_embeddings=True,  # the loader flips this when an ``output`` tensor exists
            attention_bias=False,  # the loader flips this when ``attn_q.bias`` exists
            qk_norm=arch in ("qwen3", "qwen3moe", "olmo2"),
            qk_norm_whole=arch == "olmo2",
            norm_layout="post" if arch == "olmo2" else "pre",
            embedding_multiplier=float(get("embedding_scale", 1.0)),
            residual_multiplier=float(get("residual_scale", 1.0)),
            attention_multiplier=float(attn_scale) if attn_scale else None,
            logits_scaling=float(get("logit_scale", 1.0)),
            rope_scaling=rope_scaling,
            rotary_dim=int(get("rope.dimension_count", head_dim)),
            sliding_window=int(window) if window else None,
            num_experts=experts,
            num_experts_per_tok=int(get("expert_used_count", 0) or 0),
            # Mixtral's files (arch llama) give the expert size as the feed-forward length
            moe_intermediate_size=int(get("expert_feed_forward_length", 0) or get("feed_forward_length") or 0)
            if experts else 0,
            norm_topk_prob=bool(get("expert_weights_norm", True)),
            bos_token_id=_opt_int(meta.get("tokenizer.ggml.bos_token_id")),
            eos_token_id=_opt_int(meta.get("tokenizer.ggml.eos_token_id")),
            name=str(meta.get("general.name", "")),
        )
        fields.update(gemma)
        return cls(**fields)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """From a Hugging Face ``config.json`` dict (any model type ``_HF_MODEL_TYPES`` maps)."""
        if "text_config" in d and "hidden_size" not in d:
            d = {**d["text_config"], **{k: v for k, v in d.items() if k != "text_config"}}
        model_type = d.get("model_type", "llama")
        if model_type not in _HF_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {sorted(_HF_MODEL_TYPES)}")
        arch = _HF_MODEL_TYPES[model_type]
        heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        head_dim = d.get("head_dim") or hidden // heads
        theta, partial, scaling = _hf_rope(d)
        num_layers = int(d["num_hidden_layers"])
        gemma: dict[str, Any] = {}
        if arch in ("gemma2", "gemma3"):
            gemma, theta, scaling = gemma_fields(d, arch, num_layers, float(theta), scaling)
        experts = int(d.get("num_experts") or d.get("num_local_experts") or 0)
        dense: list[int] = []
        if experts and model_type == "qwen3_moe":
            step, only = int(d.get("decoder_sparse_step", 1) or 1), set(d.get("mlp_only_layers") or [])
            dense = [i for i in range(num_layers) if i in only or (i + 1) % step]
        window, sliding = hf_windows(d, arch, num_layers) if not gemma else (d.get("sliding_window"), ())
        eos = d.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        fields: dict[str, Any] = dict(
            arch=arch,
            num_layers=num_layers,
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            intermediate_size=int(d["intermediate_size"]),
            vocab_size=int(d["vocab_size"]),
            rope_theta=float(theta),
            rms_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", arch == "qwen2")),
            qk_norm=arch in ("qwen3", "qwen3moe", "olmo2"),
            qk_norm_whole=arch == "olmo2",
            norm_layout="post" if arch == "olmo2" else "pre",
            embedding_multiplier=float(d.get("embedding_multiplier", 1.0)),
            residual_multiplier=float(d.get("residual_multiplier", 1.0)),
            attention_multiplier=float(d["attention_multiplier"]) if d.get("attention_multiplier") else None,
            logits_scaling=float(d.get("logits_scaling", 1.0)),
            rope_scaling=scaling,
            rotary_dim=int(int(head_dim) * partial),
            sliding_window=int(window) if window else None,
            num_experts=experts,
            num_experts_per_tok=int(d.get("num_experts_per_tok") or 0) if experts else 0,
            moe_intermediate_size=int(d.get("moe_intermediate_size") or d["intermediate_size"]) if experts else 0,
            norm_topk_prob=bool(d.get("norm_topk_prob", False)) if model_type == "qwen3_moe" else True,
            dense_layers=tuple(dense),
            bos_token_id=_opt_int(d.get("bos_token_id")),
            eos_token_id=_opt_int(eos),
            name=str(d.get("_name_or_path", "")),
        )
        if sliding:
            fields["sliding_layers"] = sliding
        fields.update(gemma)  # Gemma's own values for some of the fields above
        return cls(**fields)

    # ------------------------------------------------------------------ export
    def to_hf_dict(self) -> dict[str, Any]:
        """A dict transformers accepts: ``LlamaConfig(**d)`` (Llama) / ``AutoConfig.for_model(**d)``."""
        rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            rope_parameters = {**self.rope_scaling, "rope_theta": self.rope_theta}
        d: dict[str, Any] = {
            "model_type": {"qwen3moe": "qwen3_moe"}.get(self.arch, self.arch),
            "architectures": [_HF_ARCH_CLASS[self.arch]],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position,
            "rms_norm_eps": self.rms_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope_parameters,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "use_cache": True,
        }
        if self.arch == "llama":
            d["attention_bias"] = self.attention_bias
            d["mlp_bias"] = False
        if self.rotary_dim != self.head_dim:
            rope_parameters["partial_rotary_factor"] = self.rotary_dim / self.head_dim
        if self.num_experts:
            d.update(num_experts=self.num_experts, num_local_experts=self.num_experts,
                     num_experts_per_tok=self.num_experts_per_tok, moe_intermediate_size=self.moe_intermediate_size,
                     norm_topk_prob=self.norm_topk_prob, mlp_only_layers=list(self.dense_layers))
        return d




def _opt_int(x: Any) -> int | None:
    return None if x is None else int(x)


def _gguf_rope_scaling(arch: str, get: Callable[..., Any]) -> dict[str, Any] | None:
    """RoPE scaling from llama.cpp's keys: linear, or Phi-3's LongRoPE (whose per-dimension factors
    the loader adds from the ``rope_factors_*`` tensors)."""
    if get("rope.scaling.original_context_length") and arch == "phi3":
        return {
            "rope_type": "longrope",
            "original_max_position_embeddings": int(get("rope.scaling.original_context_length")),
            "attention_factor": float(get("rope.scaling.attn_factor", 1.0)),
        }
    if get("rope.scaling.type") == "linear" and get("rope.scaling.factor"):
        return {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    return None



def _hf_rope(d: dict[str, Any]) -> tuple[float, float, dict[str, Any] | None]:
    """(rope theta, partial rotary factor, rope scaling or None) of a ``config.json``. transformers
    >= 5 writes ``rope_parameters``; older files ``rope_theta`` + ``rope_scaling``."""
    rope_params = dict(d.get("rope_parameters") or {})
    theta = rope_params.pop("rope_theta", None) or d.get("rope_theta") or 10000.0
    partial = float(rope_params.pop("partial_rotary_factor", None) or d.get("partial_rotary_factor") or 1.0)
    scaling = d.get("rope_scaling") or rope_params or None
    if scaling is not None:
        scaling = dict(scaling)
        scaling.pop("rope_theta", None)
        scaling.pop("partial_rotary_factor", None)
        if "type" in scaling and "rope_type" not in scaling:
            scaling["rope_type"] = scaling.pop("type")
        if scaling.get("rope_type", "default") == "default":
            scaling = None
    if scaling is not None and scaling.get("rope_type") in ("longrope", "su"):
        scaling["rope_type"] = "longrope"
        orig = int(scaling.get("original_max_position_embeddings") or d["original_max_position_embeddings"])
        scaling["original_max_position_embeddings"] = orig
        if scaling.get("attention_factor") is None:  # as transformers derives it: from the model's own span
            factor = float(scaling.get("factor") or d["max_position_embeddings"] / orig)
            scaling["attention_factor"] = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(orig))
    return float(theta), partial, scaling
