"""The model layer: loading (GGUF / safetensors), tokenizer, Llama-family model, attention backends,
sampler, and the ``ModelRunner`` the scheduler drives.

Importing the package is cheap; the heavy modules load on first attribute access.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixserve.model.attention import TorchNativeAttention
    from radixserve.model.attention_backend import AttentionBackend, create_attention_backend
    from radixserve.model.config import ModelConfig
    from radixserve.model.llama import LlamaForCausalLM
    from radixserve.model.loader import default_model_path, load_model
    from radixserve.model.model_runner import ModelRunner
    from radixserve.model.sampler import Sampler
    from radixserve.model.tokenizer import Tokenizer

_LAZY = {
    "ModelConfig": "radixserve.model.config",
    "load_model": "radixserve.model.loader",
    "default_model_path": "radixserve.model.loader",
    "Tokenizer": "radixserve.model.tokenizer",
    "LlamaForCausalLM": "radixserve.model.llama",
    "AttentionBackend": "radixserve.model.attention_backend",
    "TorchNativeAttention": "radixserve.model.attention",
    "create_attention_backend": "radixserve.model.attention_backend",
    "Sampler": "radixserve.model.sampler",
    "ModelRunner": "radixserve.model.model_runner",
}

__all__ = [
    "AttentionBackend",
    "LlamaForCausalLM",
    "ModelConfig",
    "ModelRunner",
    "Sampler",
    "Tokenizer",
    "TorchNativeAttention",
    "create_attention_backend",
    "default_model_path",
    "load_model",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'radixserve.model' has no attribute {name!r}")
