"""Reading a Hugging Face checkpoint directory: ``config.json`` plus ``*.safetensors`` shards.

Tensors come out in the one spelling llama.py reads (``canonical_names``): Mixtral's experts under
Qwen3-MoE's names, Phi-3's fused q/k/v and gate/up cut into the separate tensors Llama has, the
language model of an image-text checkpoint (Gemma 3) under the plain names, its vision tower left
out (text only).
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import TYPE_CHECKING, TypeAlias

import torch

from radixserve.model.config import ModelConfig

if TYPE_CHECKING:
    from radixserve.model.gguf_blocks import GGUFBlocks

# a loaded checkpoint: HF name -> float tensor, or a GGUF matrix kept in its blocks
Weights: TypeAlias = "dict[str, torch.Tensor | GGUFBlocks]"

# Buffers some checkpoints carry that are recomputed here.
_SKIP_SUFFIXES = ("rotary_emb.inv_freq",)
# Mixtral's expert names -> Qwen3-MoE's
_MIXTRAL = re.compile(r"^(model\.layers\.\d+\.)block_sparse_moe\.(gate|experts\.\d+\.w[123])\.weight$")
_MIXTRAL_PROJ = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_STACKED = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(gate|up|down)_proj\.weight$")


# an image-text checkpoint's language model (either spelling transformers has written) and the
# parts of it a text-only server leaves out
_LANGUAGE_MODEL = (("language_model.model.", "model."), ("model.language_model.", "model."),
                   ("language_model.lm_head.", "lm_head."))
_VISION = ("vision_tower.", "model.vision_tower.", "multi_modal_projector.", "model.multi_modal_projector.")


def canonical_names(config: ModelConfig, state: Weights) -> Weights:
    """``state`` renamed and split into the tensors llama.py loads (views: nothing is copied; GGUF
    blocks are cut by rows the same way)."""
    out: Weights = {}
    for key, t in state.items():
        if key.startswith(_VISION):
            continue
        key = next((new + key[len(old):] for old, new in _LANGUAGE_MODEL if key.startswith(old)), key)
        m = _MIXTRAL.match(key)
        if m:
            prefix, part = m.groups()
            if part != "gate":
                expert, w = part.rsplit(".", 1)
                part = f"{expert}.{_MIXTRAL_PROJ[w]}"
            out[f"{prefix}mlp.{part}.weight"] = t
        elif key.endswith("self_attn.qkv_proj.weight"):
            q, k, v = t.split([config.q_size, config.kv_size, config.kv_size])
            base = key.removesuffix("qkv_proj.weight")
            out.update({base + "q_proj.weight": q, base + "k_proj.weight": k, base + "v_proj.weight": v})
        elif _STACKED.match(key) and t.dim() == 3:  # every expert's tensor in one (GGUF)
            base, proj = key.removesuffix(".weight").rsplit(".", 1)
            out.update({f"{base}.{e}.{proj}.weight": t[e] for e in range(t.shape[0])})
        elif key.endswith("mlp.gate_up_proj.weight") and t.dim() == 2:
            gate, up = t.chunk(2)
            base = key.removesuffix("gate_up_proj.weight")
            out.update({base + "gate_proj.weight": gate, base + "up_proj.weight": up})
        else:
            out[key] = t
    return out


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
) -> tuple[ModelConfig, Weights]:
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
    state: Weights = {}
    for handle, key in tqdm(
        keys, desc="loading safetensors", unit="tensor", file=sys.stderr, disable=not progress
    ):
        if key.endswith(_SKIP_SUFFIXES):
            continue
        state[key] = handle.get_tensor(key).to(dtype)
    state = canonical_names(config, state)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    elif "lm_head.weight" not in state:
        raise ValueError(f"{directory}: config says untied embeddings but there is no lm_head.weight")
    config.attention_bias = "model.layers.0.self_attn.q_proj.bias" in state
    config.qk_norm = "model.layers.0.self_attn.q_norm.weight" in state
    return config, state
