"""The architecture description every other model module reads.

One ``ModelConfig`` is built either from a GGUF file's metadata (llama.cpp key names) or from a
Hugging Face ``config.json``; ``to_hf_dict`` turns it back into a dict transformers accepts
(``LlamaConfig(**d)`` for Llama, ``AutoConfig.for_model(**d)`` for any), which the parity tests use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# GGUF ``general.architecture`` / HF ``model_type`` values this engine runs.
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")
_HF_ARCH_CLASS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# HF model_type -> our arch name (mistral is a plain llama here)
_HF_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


@dataclass
class ModelConfig:
    arch: str  # "llama" | "qwen2" | "qwen3"
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

    # ------------------------------------------------------------------ derived sizes
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

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
        rope_scaling: dict[str, Any] | None = None
        stype = get("rope.scaling.type")
        if stype in ("linear",) and get("rope.scaling.factor"):
            rope_scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
        return cls(
            arch=arch,
            num_layers=int(get("block_count")),
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
            qk_norm=arch == "qwen3",
            rope_scaling=rope_scaling,
            bos_token_id=_opt_int(meta.get("tokenizer.ggml.bos_token_id")),
            eos_token_id=_opt_int(meta.get("tokenizer.ggml.eos_token_id")),
            name=str(meta.get("general.name", "")),
        )

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """From a Hugging Face ``config.json`` dict (Llama, Mistral, Qwen2, Qwen3)."""
        if "text_config" in d and "hidden_size" not in d:
            d = {**d["text_config"], **{k: v for k, v in d.items() if k != "text_config"}}
        model_type = d.get("model_type", "llama")
        if model_type not in _HF_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {sorted(_HF_MODEL_TYPES)}")
        arch = _HF_MODEL_TYPES[model_type]
        heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        head_dim = d.get("head_dim") or hidden // heads
        # transformers >= 5 writes ``rope_parameters``; older files ``rope_theta`` + ``rope_scaling``
        rope_params = dict(d.get("rope_parameters") or {})
        theta = rope_params.pop("rope_theta", None) or d.get("rope_theta") or 10000.0
        scaling = d.get("rope_scaling") or rope_params or None
        if scaling is not None:
            scaling = dict(scaling)
            scaling.pop("rope_theta", None)
            if "type" in scaling and "rope_type" not in scaling:
                scaling["rope_type"] = scaling.pop("type")
            if scaling.get("rope_type", "default") == "default":
                scaling = None
        eos = d.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return cls(
            arch=arch,
            num_layers=int(d["num_hidden_layers"]),
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
            qk_norm=arch == "qwen3",
            rope_scaling=scaling,
            bos_token_id=_opt_int(d.get("bos_token_id")),
            eos_token_id=_opt_int(eos),
            name=str(d.get("_name_or_path", "")),
        )

    # ------------------------------------------------------------------ export
    def to_hf_dict(self) -> dict[str, Any]:
        """A dict transformers accepts: ``LlamaConfig(**d)`` (Llama) / ``AutoConfig.for_model(**d)``."""
        rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            rope_parameters = {**self.rope_scaling, "rope_theta": self.rope_theta}
        d: dict[str, Any] = {
            "model_type": self.arch,
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
        return d


def _opt_int(x: Any) -> int | None:
    return None if x is None else int(x)
