"""Reading a Hugging Face checkpoint directory: ``config.json`` plus ``*.safetensors`` shards."""

from __future__ import annotations

import json
import os
import sys

import torch

from radixserve.model.config import ModelConfig

# Buffers some checkpoints carry that are recomputed here.
_SKIP_SUFFIXES = ("rotary_emb.inv_freq",)


def safetensors_files(directory: str) -> list[str]:
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(directory, name) for name in sorted(set(weight_map.values()))]
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {directory}")
    return [os.path.join(directory, f) for f in files]


def load_safetensors_dir(
    directory: str, dtype: torch.dtype = torch.float32, progress: bool = True
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors import safe_open
    from tqdm import tqdm

    config_path = os.path.join(directory, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"no config.json in {directory}")
    with open(config_path) as f:
        config = ModelConfig.from_hf_dict(json.load(f))

    files = safetensors_files(directory)
    handles = [safe_open(path, framework="pt") for path in files]
    keys = [(h, k) for h in handles for k in h.keys()]
    state: dict[str, torch.Tensor] = {}
    for handle, key in tqdm(
        keys, desc="loading safetensors", unit="tensor", file=sys.stderr, disable=not progress
    ):
        if key.endswith(_SKIP_SUFFIXES):
            continue
        state[key] = handle.get_tensor(key).to(dtype)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    elif "lm_head.weight" not in state:
        raise ValueError(f"{directory}: config says untied embeddings but there is no lm_head.weight")
    config.attention_bias = "model.layers.0.self_attn.q_proj.bias" in state
    config.qk_norm = "model.layers.0.self_attn.q_norm.weight" in state
    return config, state
