"""What a ``ModelRunner``'s options resolve to before it loads: the dtype (``auto`` by the CPU),
the quantization (``auto`` by the file and the kernels), and the config a context length runs
with (a whole-model sliding window)."""

from __future__ import annotations

from dataclasses import replace

import torch

from radixserve.model.config import ModelConfig
from radixserve.model.host import cpu_flags
from radixserve.model.loader import parse_dtype, resolve_model_path


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"auto"``: bfloat16 where the CPU has native bf16 GEMMs (AMX / AVX512-BF16), else float32.

    Measured with scripts/bench_model_step.py (docs/model.md): on an AVX512-BF16 EPYC a batch-64
    decode step is ~12% faster in bf16 (attention, memory-bound, gains nothing) and prefill ~21%;
    on an AVX2-only CPU, where bf16 is emulated, a step costs ~6x more than float32. bf16 logits
    depend on the batch shape; ``float32`` is the choice when outputs must not depend on batching.
    """
    if isinstance(dtype, str) and dtype.lower() == "auto":
        flags = cpu_flags()
        return torch.bfloat16 if {"amx_bf16", "avx512_bf16"} & flags else torch.float32
    return parse_dtype(dtype)


def resolve_quantization(name: str, model_path: str | None) -> str:
    """``auto``: ``gguf`` for a GGUF model (its quantized matrices stay in their blocks and every
    forward reads them there: gguf_blocks.py) where the block kernels build, else ``none`` (float
    weights). ``gguf`` insists on that. Under tensor parallelism each rank keeps its shard's blocks
    (llama.py ``load_weights``). Any other name is returned as it is."""
    if name not in ("auto", "gguf"):
        return name
    from radixserve.model.dequant import block_types

    is_gguf = resolve_model_path(model_path)[0] == "gguf"
    if name == "gguf":
        if not is_gguf:
            raise ValueError("--quantization gguf needs a GGUF model (it keeps the file's own blocks)")
        if not block_types():
            raise RuntimeError("--quantization gguf needs the GGUF block kernels, which did not build here")
        return name
    return "gguf" if is_gguf and block_types() else "none"


def windowed(config: ModelConfig, context_length: int | None) -> tuple[ModelConfig, int]:
    """The config a model runs with, and its context (``context_length``, else the model's span).

    A whole-model sliding window (Mistral 7B v0.1, Phi-3-mini: a window and no per-layer pattern)
    becomes a window on every layer when the context is longer than the window; when it is not,
    full causal attention gives the same outputs, and the layers keep the faster full path."""
    context = context_length or config.max_position
    window = config.sliding_window
    if window is not None and not config.sliding_layers and window < context:
        config = replace(config, sliding_layers=tuple(range(config.num_layers)))
    return config, context
