"""``DecoderLayer``: one transformer block, attention then MLP, each wrapped in the norms the
family's layout has (``NORMS``), with the fused small-op path for decode (``forward_fused``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from radixserve.mem.forward_batch import ForwardBatch
from radixserve.mem.kv_pool import KVPool, ReqToTokenPool
from radixserve.model.attention_backend import AttentionBackend
from radixserve.model.config import ModelConfig
from radixserve.model.fused_ops import TorchOps
from radixserve.model.layers import MLP, Attention, RMSNorm, SparseMoE
from radixserve.model.parallel import TPGroup

# Each layout's norms: our name (by role) -> the HF checkpoint's name. HF's names do not say the
# role: ``post_attention_layernorm`` is the MLP's input norm in Llama, the attention output's in
# OLMo 2 and Gemma.
NORMS = {
    "pre": {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"},
    "post": {"attn_out_norm": "post_attention_layernorm", "mlp_out_norm": "post_feedforward_layernorm"},
    "sandwich": {"attn_norm": "input_layernorm", "attn_out_norm": "post_attention_layernorm",
                 "mlp_norm": "pre_feedforward_layernorm", "mlp_out_norm": "post_feedforward_layernorm"},
}


class DecoderLayer(nn.Module):
    """``h + out_norm(attn(norm(h)))``, then the same for the MLP, with the norms the layout has
    (``config.norm_layout``: pre, post or sandwich); a missing norm is the identity."""

    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.residual_multiplier = config.residual_multiplier
        self.sliding = layer_id in config.sliding_layers  # attends over the window, with the local RoPE
        have = NORMS[config.norm_layout]

        def norm(role: str) -> RMSNorm | None:
            return RMSNorm(config.hidden_size, config.rms_eps, dtype) if role in have else None

        self.attn_norm, self.attn_out_norm = norm("attn_norm"), norm("attn_out_norm")
        self.mlp_norm, self.mlp_out_norm = norm("mlp_norm"), norm("mlp_out_norm")
        self.self_attn = Attention(config, layer_id, dtype, tp)
        self.mlp: MLP | SparseMoE = (
            SparseMoE(config, dtype, tp) if config.is_moe_layer(layer_id)
            else MLP(config.hidden_size, config.intermediate_size, dtype, tp, act=config.hidden_act)
        )

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: AttentionBackend,
        fb: ForwardBatch,
        kv_pool: KVPool,
        r2t: ReqToTokenPool,
    ) -> torch.Tensor:
        def around(x: torch.Tensor, inner: Callable[[torch.Tensor], torch.Tensor], before: RMSNorm | None,
                   after: RMSNorm | None) -> torch.Tensor:
            y = inner(before(x) if before is not None else x)
            y = after(y) if after is not None else y
            return x + (y if self.residual_multiplier == 1 else y * self.residual_multiplier)

        h = around(h, lambda x: self.self_attn(x, cos, sin, backend, fb, kv_pool, r2t), self.attn_norm,
                   self.attn_out_norm)
        return around(h, self.mlp, self.mlp_norm, self.mlp_out_norm)

    def forward_fused(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        next_norm: RMSNorm | None,
        ops: TorchOps,
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: AttentionBackend,
        fb: ForwardBatch,
        kv_pool: KVPool,
        r2t: ReqToTokenPool,
    ) -> torch.Tensor:
        """``forward`` with the residual adds folded into the next norm: ``x`` is this layer's
        normalised input, ``residual`` the running hidden state (updated in place); returns the
        next layer's normalised input (``next_norm``), or, for the last layer, nothing new
        (``residual`` then holds the output)."""
        # submodules are run through .forward, not nn.Module.__call__: no hooks are used here, and
        # __call__'s ~1 us times six calls a layer is ~0.2 ms of a batch-1 decode step
        rm = self.residual_multiplier
        a = self.self_attn.forward(x, cos, sin, backend, fb, kv_pool, r2t, ops)
        if rm != 1:
            a.mul_(rm)
        n = self.mlp_norm
        assert n is not None  # the fused path runs pre-norm layers only
        x = ops.add_rms_norm(a, residual, n.weight, n.eps)
        m = self.mlp.forward(x, ops)
        if rm != 1:
            m.mul_(rm)
        if next_norm is None:
            residual.add_(m)
            return residual
        return ops.add_rms_norm(m, residual, next_norm.weight, next_norm.eps)
