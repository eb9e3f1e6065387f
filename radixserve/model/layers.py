"""The layers every family's decoder is built of: RMSNorm, RoPE tables, attention over the paged
KV pool, the MLP and the routed-experts MLP (``SparseMoE``). Which of them a layer uses, and with
which settings, comes from ``ModelConfig`` fields (config.py); llama.py stacks them.

Each layer's submodules are called through ``.forward``, not ``nn.Module.__call__``, on the hot
path (see ``DecoderLayer.forward_fused``): no hooks are used.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.mem.forward_batch import ForwardBatch
from radixserve.mem.kv_pool import KVPool, ReqToTokenPool
from radixserve.model.attention_backend import AttentionBackend
from radixserve.model.config import ModelConfig
from radixserve.model.fused_ops import TorchOps
from radixserve.model.linear import Linear, empty_param
from radixserve.model.parallel import TPGroup

_TORCH_OPS = TorchOps()


class RMSNorm(nn.Module):
    """HF's LlamaRMSNorm: normalize in float32, cast back, then scale."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = empty_param(dim, dtype=dtype)

    def forward(self, x: torch.Tensor, ops: TorchOps = _TORCH_OPS) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


def rope_inv_freq(config: ModelConfig, context_len: int | None = None) -> torch.Tensor:
    """RoPE inverse frequencies exactly as transformers computes them (float32), plus scaling, for
    the ``rotary_dim`` dimensions RoPE turns.

    LongRoPE has two sets of per-dimension factors, short and long; ``context_len`` (the longest
    sequence this model will run; default the model's own span) picks one for every position, as
    llama.cpp does by its context size: short where the context fits the original span."""
    import math

    dim = config.rotary_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if config.rope_freq_factors is not None:
        inv = inv / torch.tensor(config.rope_freq_factors, dtype=torch.float32)
    sc = config.rope_scaling
    kind = (sc or {}).get("rope_type", (sc or {}).get("type", "default"))
    if not sc or kind == "default":
        return inv
    if kind == "linear":
        return inv / float(sc["factor"])
    if kind == "longrope":
        long = (context_len or config.max_position) > int(sc["original_max_position_embeddings"])
        factors = torch.tensor(sc["long_factor" if long else "short_factor"], dtype=torch.float32)
        if factors.shape != inv.shape:
            raise ValueError(f"LongRoPE needs {inv.numel()} factors per set, the model gives {factors.numel()}")
        return inv / factors
    if kind == "llama3":
        factor = float(sc["factor"])
        low = float(sc.get("low_freq_factor", 1.0))
        high = float(sc.get("high_freq_factor", 4.0))
        old_ctx = float(sc.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise NotImplementedError(f"rope scaling type {kind!r} is not supported")


def rope_attention_factor(config: ModelConfig) -> float:
    """What LongRoPE multiplies cos and sin by (1 for every other kind)."""
    sc = config.rope_scaling or {}
    return float(sc.get("attention_factor") or 1.0) if sc.get("rope_type") == "longrope" else 1.0


def rope_tables(
    config: ModelConfig, context_len: int | None, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """cos and sin per position (``[P, rotary_dim/2]``: only one half is kept), computed in float32
    as HF does, then cast; and the sliding layers' own (Gemma 3's local RoPE base), or None where
    they share the first two."""
    positions = torch.arange(context_len or config.max_position, dtype=torch.float32)
    freqs = torch.outer(positions, rope_inv_freq(config, context_len))
    scale = rope_attention_factor(config)
    cos, sin = (freqs.cos() * scale).to(dtype), (freqs.sin() * scale).to(dtype)
    if config.local_rope_theta is None:
        return cos, sin, None, None
    local = replace(config, rope_theta=config.local_rope_theta, rope_scaling=None, rope_freq_factors=None)
    local_freqs = torch.outer(positions, rope_inv_freq(local, context_len))
    return cos, sin, local_freqs.cos().to(dtype), local_freqs.sin().to(dtype)


class Attention(nn.Module):
    """Under tensor parallelism: this rank's heads only (column-parallel qkv), and a row-parallel
    o_proj whose partial sums are all-reduced."""

    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype, tp: TPGroup | None = None) -> None:
        super().__init__()
        tp_size = tp.size if tp is not None else 1
        self.tp = tp
        self.layer_id = layer_id
        self.num_heads = config.num_heads // tp_size
        self.num_kv_heads = config.num_kv_heads // tp_size
        self.head_dim = config.head_dim
        self.rotary_dim = config.rotary_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, config.attention_bias, dtype
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, False, dtype)
        # per head (Qwen3), or over the whole projection (OLMo 2; tensor parallelism refuses it)
        self.qk_norm_whole = config.qk_norm_whole
        q_dim, k_dim = (self.q_size, self.kv_size) if config.qk_norm_whole else (self.head_dim, self.head_dim)
        self.q_norm = RMSNorm(q_dim, config.rms_eps, dtype) if config.qk_norm else None
        self.k_norm = RMSNorm(k_dim, config.rms_eps, dtype) if config.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: AttentionBackend,
        fb: ForwardBatch,
        kv_pool: KVPool,
        r2t: ReqToTokenPool,
        ops: TorchOps = _TORCH_OPS,
    ) -> torch.Tensor:
        """``cos, sin: [T, rotary_dim/2]``. ``ops`` rotates q and k (the C++ ops in place, inside ``qkv``)."""
        T = x.shape[0]
        H, KVH, D = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj.forward(x)  # .forward: see DecoderLayer.forward_fused
        v = qkv[:, self.q_size + self.kv_size :].view(T, KVH, D)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qkv[:, : self.q_size], qkv[:, self.q_size : self.q_size + self.kv_size]
            if not self.qk_norm_whole:
                q, k = q.view(T, H, D), k.view(T, KVH, D)
            q = self.q_norm(q).view(T, H, D)
            k = self.k_norm(k).view(T, KVH, D)
            qk = torch.cat([q, k], dim=1)
        else:
            qk = qkv[:, : self.q_size + self.kv_size].view(T, H + KVH, D)
        if self.rotary_dim == D:  # q and k rotated in one go: [T, H + KVH, D]
            qk = ops.rope(qk, cos, sin)
        else:  # partial rotary: the first rotary_dim dimensions of each head turn, the rest pass
            R = self.rotary_dim
            qk = torch.cat([ops.rope(qk[..., :R], cos, sin), qk[..., R:]], dim=-1)
        q, k = qk[:, :H], qk[:, H:]
        out = self.o_proj.forward(backend.forward(q, k, v, self.layer_id, fb, kv_pool, r2t))
        return out if self.tp is None else self.tp.all_reduce_(out)


class MLP(nn.Module):
    """Under tensor parallelism: this rank's slice of the intermediate rows (column-parallel
    gate/up, row-parallel down_proj, all-reduced unless ``reduce`` is off: an expert's partial
    sums are reduced once for the whole MoE layer)."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        dtype: torch.dtype,
        tp: TPGroup | None = None,
        reduce: bool = True,
        act: str = "silu",
    ) -> None:
        super().__init__()
        self.tp = tp if reduce else None
        self.gelu = act == "gelu_tanh"  # GeGLU (Gemma): tanh-approximated GELU of the gate
        start, end = tp.split(intermediate) if tp is not None else (0, intermediate)
        self.rows = (start, end)
        self.intermediate = end - start
        self.gate_up_proj = Linear(hidden, 2 * self.intermediate, False, dtype)
        self.down_proj = Linear(self.intermediate, hidden, False, dtype)

    def forward(self, x: torch.Tensor, ops: TorchOps = _TORCH_OPS) -> torch.Tensor:
        gate_up = self.gate_up_proj.forward(x)
        if self.gelu:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.gelu(gate, approximate="tanh") * up
        else:
            act = ops.silu_mul(gate_up)
        out = self.down_proj.forward(act)
        return out if self.tp is None else self.tp.all_reduce_(out)


class SparseMoE(nn.Module):
    """Routed experts: each token goes to the ``num_experts_per_tok`` experts with the largest
    softmax probability, weighted by it (renormalized over the chosen ones where the family does).
    The router is kept in the model's float dtype, never quantized: a rounded router changes which
    experts run, not just by how much. Each expert is an ordinary ``MLP`` of ``Linear`` layers, so
    packing and weight quantization treat experts as any other linear; a step runs, per expert in
    use, one gather of its rows, its two GEMMs and a weighted scatter-add."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = empty_param(config.num_experts, config.hidden_size, dtype=dtype)
        self.experts = nn.ModuleList(
            MLP(config.hidden_size, config.moe_intermediate_size, dtype, tp, reduce=False)
            for _ in range(config.num_experts)
        )

    def forward(self, x: torch.Tensor, ops: TorchOps = _TORCH_OPS) -> torch.Tensor:
        probs = torch.softmax(F.linear(x, self.gate), dim=-1, dtype=torch.float32)
        weights, chosen = probs.topk(self.top_k, dim=-1)  # [T, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if x.shape[0] == 1:  # one token (a decode step at batch 1): its experts run on it directly
            return self._one_token(x, weights, chosen, ops)
        return self._grouped(x, weights, chosen, ops)

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, ops: TorchOps) -> torch.Tensor:
        """Group the (token, choice) pairs by expert: one gather and two GEMMs per expert in use."""
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)
        rows_of = order // self.top_k
        weight_of = weights.reshape(-1).index_select(0, order).to(x.dtype).unsqueeze(1)
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(torch.bincount(flat, minlength=len(self.experts)).tolist()):
            if n:
                rows = rows_of[start : start + n]
                y = self.experts[e].forward(x.index_select(0, rows), ops)
                out.index_add_(0, rows, y * weight_of[start : start + n])
                start += n
        return out if self.tp is None else self.tp.all_reduce_(out)

    def _one_token(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, ops: TorchOps) -> torch.Tensor:
        """``forward`` for a single token without the grouping's gathers and scatters: the same
        products added in the same order (experts by index), so the same bits."""
        ids = chosen[0].tolist()
        w = weights[0].to(x.dtype)
        out = torch.zeros_like(x)
        for j in sorted(range(self.top_k), key=ids.__getitem__):
            out.add_(self.experts[ids[j]].forward(x, ops) * w[j])
        return out if self.tp is None else self.tp.all_reduce_(out)
