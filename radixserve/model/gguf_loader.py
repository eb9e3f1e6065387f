"""Reading a GGUF file: metadata, config, and dequantized weights under Hugging Face names.

llama.cpp's ``convert_hf_to_gguf.py`` renames every tensor, stores shapes in ``ne`` order (reversed
from torch) and, for the ``llama`` architecture only, permutes the rows of ``q_proj`` and ``k_proj``
so that its RoPE can rotate adjacent pairs. We rename back and undo that permutation so the weights
are the ones the HF checkpoint had and HF's ``rotate_half`` RoPE applies.

With ``keep_blocks`` every quantized matrix of a type the block kernels read stays in its blocks
(``GGUFBlocks``, gguf_blocks.py: a view of the memory-mapped file where no row moves); otherwise,
and for every other tensor, we dequantize (dequant.py: the common types in C++, bit for bit as
``gguf.quants``, which takes any other type it knows).
"""

from __future__ import annotations

import logging
import re
import sys

import numpy as np
import torch

from radixserve.model.config import ModelConfig
from radixserve.model.gguf_blocks import GGUFBlocks
from radixserve.model.gguf_file import GGUFTensor, open_gguf
from radixserve.model.safetensors_loader import Weights, canonical_names

logger = logging.getLogger(__name__)

# Tensors outside the blocks.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Per-block suffixes: ``blk.N.<gguf>`` -> ``model.layers.N.<hf>``.
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3: fused, cut up by canonical_names
    "ffn_gate_inp": "mlp.gate",  # the MoE router
    "ffn_gate_exps": "mlp.experts.gate_proj",  # [experts, rows, cols]: one tensor for every expert
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "post_attention_norm": "post_attention_layernorm",  # OLMo 2's norms on the branch outputs
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Per-architecture exceptions: Phi-3's fused gate/up is stored as ``ffn_up``; Gemma's ``ffn_norm``
# is the norm before the MLP in a layer that also has one after it.
_ARCH_BLOCK_NAMES = {
    "phi3": {"ffn_up": "mlp.gate_up_proj"},
    "gemma2": {"ffn_norm": "pre_feedforward_layernorm"},
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm"},
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# Tensors that carry no weights of their own (rope frequency factors go into the config).
# LongRoPE's factor sets go into the config's rope_scaling (HF's keys).
_SPECIAL = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}


def gguf_to_hf_name(name: str, arch: str = "llama") -> str:
    """The HF state-dict name of a GGUF tensor; KeyError for one this engine does not know."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _BLOCK_RE.match(name)
    if m:
        hf = _ARCH_BLOCK_NAMES.get(arch, {}).get(m.group(2)) or _BLOCK_NAMES.get(m.group(2))
        if hf:
            return f"model.layers.{m.group(1)}.{hf}.{m.group(3)}"
    raise KeyError(f"unknown GGUF tensor name {name!r}")


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's ``permute`` of q/k rows (works on weights ``[out, in]`` and biases ``[out]``).

    llama.cpp: ``w.reshape(n_head, 2, hd // 2, *rest).swapaxes(1, 2).reshape(w.shape)``.
    """
    rest = tuple(w.shape[1:])
    head_dim = w.shape[0] // n_head
    return w.reshape(n_head, head_dim // 2, 2, *rest).transpose(1, 2).reshape(w.shape).contiguous()


def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's permutation (for tests: ``unpermute_qk(permute_qk(w)) == w``)."""
    rest = tuple(w.shape[1:])
    head_dim = w.shape[0] // n_head
    return w.reshape(n_head, 2, head_dim // 2, *rest).transpose(1, 2).reshape(w.shape).contiguous()


def load_gguf(
    path: str, dtype: torch.dtype = torch.float32, progress: bool = True, keep_blocks: bool = False
) -> tuple[ModelConfig, Weights]:
    """Config and HF-named state dict of a GGUF file: float tensors of ``dtype``, and with
    ``keep_blocks`` the quantized matrices as ``GGUFBlocks``."""
    from tqdm import tqdm

    from radixserve.model.dequant import FLOAT_TYPES, block_types, dequantize

    reader = open_gguf(path)
    config = ModelConfig.from_gguf_metadata(reader.metadata)
    state: Weights = {}
    in_blocks = block_types() if keep_blocks else frozenset()
    expanded = sorted({t.tensor_type.name for t in reader.tensors if keep_blocks and len(t.shape) >= 2
                       and int(t.tensor_type) not in in_blocks | FLOAT_TYPES})
    if expanded:
        logger.warning("%s: no block kernel here for %s: those tensors are expanded to float at load",
                       path, ", ".join(expanded))
    names = [t.name for t in reader.tensors]
    unknown = [n for n in names if n not in _SPECIAL and not _is_known(n, config.arch)]
    if unknown:
        raise ValueError(f"{path}: GGUF tensors this loader cannot map: {unknown[:8]}")
    permute = config.arch in ("llama", "granite")  # convert_hf_to_gguf permutes q/k for LlamaModel and its subclasses
    for t in tqdm(reader.tensors, desc="loading gguf", unit="tensor", file=sys.stderr, disable=not progress):
        if int(t.tensor_type) in in_blocks and len(t.shape) >= 2 and t.name not in _SPECIAL:
            name = gguf_to_hf_name(t.name, config.arch)
            blocks = _blocks(t)
            if permute and (".q_proj." in name or ".k_proj." in name):
                n_head = config.num_heads if ".q_proj." in name else config.num_kv_heads
                blocks = GGUFBlocks(unpermute_qk(blocks.data, n_head), blocks.qtype, blocks.cols)
            state[name] = blocks
            continue
        arr = dequantize(t.data, t.tensor_type)
        shape = tuple(reversed(t.shape))  # ne order -> torch order
        arr = np.ascontiguousarray(arr, dtype=np.float32).reshape(shape)
        if not arr.flags.writeable:  # F32 tensors come back as views of the read-only memmap
            arr = arr.copy()
        tensor = torch.from_numpy(arr)
        if t.name in _SPECIAL:
            values = [float(x) for x in tensor.reshape(-1).tolist()]
            if t.name == "rope_freqs.weight":
                config.rope_freq_factors = values
            elif config.rope_scaling is not None and config.rope_scaling.get("rope_type") == "longrope":
                config.rope_scaling[t.name.removeprefix("rope_factors_").split(".")[0] + "_factor"] = values
            else:
                raise ValueError(f"{path}: {t.name} without LongRoPE metadata (rope.scaling.original_context_length)")
            continue
        name = gguf_to_hf_name(t.name, config.arch)
        if permute and (".q_proj." in name or ".k_proj." in name):
            n_head = config.num_heads if ".q_proj." in name else config.num_kv_heads
            tensor = unpermute_qk(tensor, n_head)
        state[name] = tensor.to(dtype)
    state = canonical_names(config, state)
    if config.num_experts:  # llama.cpp's MoE families have no dense layers; a file may say otherwise
        config.dense_layers = tuple(
            i for i in range(config.num_layers) if f"model.layers.{i}.mlp.gate.weight" not in state
        )
    config.tie_word_embeddings = "lm_head.weight" not in state
    config.attention_bias = "model.layers.0.self_attn.q_proj.bias" in state
    config.qk_norm = "model.layers.0.self_attn.q_norm.weight" in state
    emb = state.get("model.embed_tokens.weight")
    if emb is not None and emb.shape[0] != config.vocab_size:
        config.vocab_size = int(emb.shape[0])
    return config, state


def _blocks(t: GGUFTensor) -> GGUFBlocks:
    """A quantized tensor's blocks as a read-only view of the memory-mapped file (no copy)."""
    import warnings

    shape = tuple(int(d) for d in reversed(t.shape))
    raw = np.asarray(t.data).view(np.uint8).reshape(*shape[:-1], -1)
    with warnings.catch_warnings():  # the kernels only read it
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        data = torch.from_numpy(raw)
    return GGUFBlocks(data, int(t.tensor_type), shape[-1])


def gguf_tensor_bytes(path: str) -> int:
    """The bytes of every tensor in a GGUF file (what its weights take in memory, read in place)."""
    return sum(int(t.data.nbytes) for t in open_gguf(path).tensors)


def _is_known(name: str, arch: str) -> bool:
    try:
        gguf_to_hf_name(name, arch)
    except KeyError:
        return False
    return True
