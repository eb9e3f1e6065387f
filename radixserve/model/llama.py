"""Llama-family decoder (Llama, Mistral, Mixtral, Qwen2, Qwen3, Qwen3-MoE, Phi-3) in plain PyTorch,
over a paged KV pool. How the families differ, and which config fields say so: config.py.

The state dict stays in Hugging Face naming (``model.layers.N.self_attn.q_proj.weight``...), which is
what the loaders produce and what the parity tests feed to transformers. Every family's checkpoint
comes in one spelling (loader.py): q/k/v and gate/up as separate tensors, experts as Qwen3-MoE names
them (``mlp.gate``, ``mlp.experts.E.gate_proj``...). At build time q/k/v are fused into one
``qkv_proj`` and gate/up into one ``gate_up_proj`` (fewer, larger GEMMs).

An MoE layer runs each expert on the rows routed to it (a gather, the expert's two GEMMs, a
weighted scatter-add): each expert is an ordinary MLP of ``Linear`` layers, so packing and weight
quantization treat experts as they treat any other linear.

``forward`` consumes a ``ForwardBatch`` (flat new tokens of all requests) and returns the logits of
each request's last new token only: the LM head never runs on the other positions.

With a ``TPGroup`` (tensor parallelism, parallel.py) each rank builds and loads only its shard of
every layer; without one (``tp`` None) nothing of that runs: no collective, no masking.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.mem.forward_batch import ForwardBatch
from radixserve.mem.kv_pool import KVPool, ReqToTokenPool
from radixserve.model.attention import AttentionBackend, create_attention_backend
from radixserve.model.config import ModelConfig
from radixserve.model.fused_ops import TorchOps, make_small_ops
from radixserve.model.linear import Linear, empty_param
from radixserve.model.parallel import TPGroup
from radixserve.model.quant import DEFAULT_MAX_ROWS

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
        self.q_norm = RMSNorm(self.head_dim, config.rms_eps, dtype) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_eps, dtype) if config.qk_norm else None

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
            q = self.q_norm(qkv[:, : self.q_size].view(T, H, D))
            k = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].view(T, KVH, D))
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
        self, hidden: int, intermediate: int, dtype: torch.dtype, tp: TPGroup | None = None, reduce: bool = True
    ) -> None:
        super().__init__()
        self.tp = tp if reduce else None
        start, end = tp.split(intermediate) if tp is not None else (0, intermediate)
        self.rows = (start, end)
        self.intermediate = end - start
        self.gate_up_proj = Linear(hidden, 2 * self.intermediate, False, dtype)
        self.down_proj = Linear(self.intermediate, hidden, False, dtype)

    def forward(self, x: torch.Tensor, ops: TorchOps = _TORCH_OPS) -> torch.Tensor:
        out = self.down_proj.forward(ops.silu_mul(self.gate_up_proj.forward(x)))
        return out if self.tp is None else self.tp.all_reduce_(out)


class SparseMoE(nn.Module):
    """Routed experts: each token goes to the ``num_experts_per_tok`` experts with the largest
    softmax probability, weighted by it (renormalized over the chosen ones where the family does).
    The router is kept in the model's float dtype, never quantized: a rounded router changes which
    experts run, not just by how much."""

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
        # group the (token, choice) pairs by expert: one gather and two GEMMs per expert in use
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


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_eps, dtype)
        self.self_attn = Attention(config, layer_id, dtype, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_eps, dtype)
        self.mlp: MLP | SparseMoE = (
            SparseMoE(config, dtype, tp) if config.is_moe_layer(layer_id)
            else MLP(config.hidden_size, config.intermediate_size, dtype, tp)
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
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, backend, fb, kv_pool, r2t)
        return h + self.mlp(self.post_attention_layernorm(h))

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
        a = self.self_attn.forward(x, cos, sin, backend, fb, kv_pool, r2t, ops)
        n = self.post_attention_layernorm
        x = ops.add_rms_norm(a, residual, n.weight, n.eps)
        m = self.mlp.forward(x, ops)
        if next_norm is None:
            residual.add_(m)
            return residual
        return ops.add_rms_norm(m, residual, next_norm.weight, next_norm.eps)


class LlamaForCausalLM(nn.Module):
    cos_cache: torch.Tensor
    sin_cache: torch.Tensor

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        attention_backend: str | AttentionBackend = "auto",
        tp: TPGroup | None = None,
        context_len: int | None = None,
    ) -> None:
        """``tp``: build this rank's shard only (the vocabulary rows of the embedding and LM head,
        the heads and intermediate rows of every layer); the heads must divide (check_tp_size).
        ``context_len``: the longest sequence it will run (default the model's span): the RoPE
        tables cover it, and LongRoPE picks its factors by it."""
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.tp = tp
        v0, v1, vocab_rows = tp.vocab_range(config.vocab_size) if tp else (0, config.vocab_size, config.vocab_size)
        self.vocab_range = (v0, v1)
        self.embed_tokens = empty_param(vocab_rows, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(config, i, dtype, tp) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_eps, dtype)
        self.lm_head = Linear(config.hidden_size, vocab_rows, False, dtype)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens
        if isinstance(attention_backend, str):
            tp_size = tp.size if tp else 1
            attention_backend = create_attention_backend(
                attention_backend, config.num_heads // tp_size, config.num_kv_heads // tp_size, config.head_dim
            )
        self.attn_backend = attention_backend
        # the small per-layer ops go with the backend: the C++ ones where the backend is the C++ one
        self.small_ops: TorchOps = make_small_ops("auto" if attention_backend.fused_small_ops else "torch")
        # cos/sin per position, computed in float32 as HF does, then cast; only one half is kept.
        positions = torch.arange(context_len or config.max_position, dtype=torch.float32)
        freqs = torch.outer(positions, rope_inv_freq(config, context_len))  # [P, rotary_dim/2]
        scale = rope_attention_factor(config)
        self.register_buffer("cos_cache", (freqs.cos() * scale).to(dtype), persistent=False)
        self.register_buffer("sin_cache", (freqs.sin() * scale).to(dtype), persistent=False)

    # ------------------------------------------------------------------ weights
    @classmethod
    def from_state_dict(
        cls,
        config: ModelConfig,
        state_dict: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        attention_backend: str | AttentionBackend = "auto",
        tp: TPGroup | None = None,
        context_len: int | None = None,
    ) -> LlamaForCausalLM:
        model = cls(config, dtype, attention_backend, tp, context_len)
        model.load_weights(state_dict)
        return model.eval()

    @torch.no_grad()
    def load_weights(self, sd: dict[str, torch.Tensor]) -> None:
        """Copy an HF-named state dict in, fusing q/k/v and gate/up. Every parameter must be set.

        Under tensor parallelism the whole tensors come in and this rank's rows / columns are cut
        out here: every rank reads the whole checkpoint, which is fine for small models (a large
        one would want each rank to read only its slices from the file)."""
        used: set[str] = set()

        def take(name: str) -> torch.Tensor:
            if name not in sd:
                raise KeyError(f"state dict lacks {name}")
            used.add(name)
            return sd[name]

        c, D = self.config, self.config.head_dim
        tp_size, rank = (self.tp.size, self.tp.rank) if self.tp is not None else (1, 0)
        hq, hk = c.num_heads // tp_size, c.num_kv_heads // tp_size
        q_part, kv_part = slice(rank * hq * D, (rank + 1) * hq * D), slice(rank * hk * D, (rank + 1) * hk * D)
        v0, v1 = self.vocab_range

        def vocab_rows(dst: torch.Tensor, src: torch.Tensor) -> None:
            dst[: v1 - v0].copy_(src[v0:v1])
            dst[v1 - v0 :].zero_()  # padding of the last rank's slice: never looked up, its logits cut off

        vocab_rows(self.embed_tokens, take("model.embed_tokens.weight"))
        self.norm.weight.copy_(take("model.norm.weight"))
        if not c.tie_word_embeddings:
            vocab_rows(self.lm_head.weight, take("lm_head.weight"))
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, DecoderLayer)
            p = f"model.layers.{i}."
            a = layer.self_attn
            parts = (q_part, kv_part, kv_part)
            a.qkv_proj.weight.copy_(
                torch.cat([take(p + f"self_attn.{n}_proj.weight")[r] for n, r in zip("qkv", parts, strict=True)])
            )
            if a.qkv_proj.bias is not None:
                a.qkv_proj.bias.copy_(
                    torch.cat([take(p + f"self_attn.{n}_proj.bias")[r] for n, r in zip("qkv", parts, strict=True)])
                )
            a.o_proj.weight.copy_(take(p + "self_attn.o_proj.weight")[:, q_part])
            if a.q_norm is not None and a.k_norm is not None:
                a.q_norm.weight.copy_(take(p + "self_attn.q_norm.weight"))
                a.k_norm.weight.copy_(take(p + "self_attn.k_norm.weight"))
            for mlp, prefix in self._mlps(layer, p):
                r0, r1 = mlp.rows
                mlp.gate_up_proj.weight.copy_(
                    torch.cat([take(prefix + "gate_proj.weight")[r0:r1], take(prefix + "up_proj.weight")[r0:r1]])
                )
                mlp.down_proj.weight.copy_(take(prefix + "down_proj.weight")[:, r0:r1])
            if isinstance(layer.mlp, SparseMoE):
                layer.mlp.gate.copy_(take(p + "mlp.gate.weight"))
            layer.input_layernorm.weight.copy_(take(p + "input_layernorm.weight"))
            layer.post_attention_layernorm.weight.copy_(take(p + "post_attention_layernorm.weight"))
        unused = [
            k for k in sd if k not in used and not (k == "lm_head.weight" and c.tie_word_embeddings)
        ]
        if unused:
            raise ValueError(f"state dict has tensors this model does not use: {unused[:8]}")

    @staticmethod
    def _mlps(layer: DecoderLayer, p: str) -> list[tuple[MLP, str]]:
        """A layer's MLPs (the dense one, or every expert) and their state-dict name prefixes."""
        if isinstance(layer.mlp, SparseMoE):
            return [(e, p + f"mlp.experts.{i}.") for i, e in enumerate(layer.mlp.experts) if isinstance(e, MLP)]
        return [(layer.mlp, p + "mlp.")]

    def pack_linears(self, batch_hint: int = 64, drop_plain_weights: bool = False) -> int:
        """Pre-pack every linear for oneDNN where possible; returns how many were packed.

        ``drop_plain_weights`` frees the unpacked copies (not the tied embedding), halving weight
        memory; ``state_dict()`` then no longer holds those weights."""
        n = 0
        for m in self.modules():
            if isinstance(m, Linear) and m.pack(batch_hint):
                n += 1
                if drop_plain_weights and m.weight is not self.embed_tokens:
                    m.drop_plain_weight()
        return n

    def quantize_linears(self, method: str, max_rows: int = DEFAULT_MAX_ROWS, kernel: str = "auto") -> int:
        """Give every linear a ``method`` weight copy for inputs of at most ``max_rows`` rows
        (quant.py; ``kernel``: see ``quantize_weight``); returns how many. Call before ``pack_linears``.

        NOTE: under ``int4`` the LM head gets ``int8``: its rows are the (tied) embedding, which GGUF
        files keep at 8 bits (Q8_0 here), and 4-bit groups of it moved greedy tokens several times
        more than all the layers' int4 together (docs/model.md). llama.cpp keeps it wider too."""
        n = 0
        for m in self.modules():
            if isinstance(m, Linear):
                m.quantize("int8" if method == "int4" and m is self.lm_head else method, max_rows, kernel)
                n += 1
        return n

    def linear_sources(self) -> dict[Linear, list[str]]:
        """Each linear and the HF tensors its weight is made of (fused q/k/v and gate/up; the LM
        head is the embedding when tied)."""
        out: dict[Linear, list[str]] = {}
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, DecoderLayer)
            p = f"model.layers.{i}."
            out[layer.self_attn.qkv_proj] = [p + f"self_attn.{n}_proj.weight" for n in "qkv"]
            out[layer.self_attn.o_proj] = [p + "self_attn.o_proj.weight"]
            for mlp, prefix in self._mlps(layer, p):
                out[mlp.gate_up_proj] = [prefix + "gate_proj.weight", prefix + "up_proj.weight"]
                out[mlp.down_proj] = [prefix + "down_proj.weight"]
        tied = self.config.tie_word_embeddings
        out[self.lm_head] = ["model.embed_tokens.weight" if tied else "lm_head.weight"]
        return out

    def quantize_like_file(self, types: dict[str, str], max_rows: int = DEFAULT_MAX_ROWS) -> int:
        """Give each linear whose GGUF tensors are all Q4_1 (or all Q8_0) a copy in that same format
        (``int4`` / ``int8`` blocks, the block kernel: quant.py), so it reads the file's own bytes;
        other linears keep their float weights. ``types``: ``gguf_tensor_types``. Returns how many.

        Lossless where the weights were dequantized from those blocks in float32 (call on a float32
        model, before casting it: ``ModelRunner`` does)."""
        n = 0
        for lin, names in self.linear_sources().items():
            kinds = {types.get(name, "?") for name in names}
            method = {"Q4_1": "int4", "Q8_0": "int8"}.get(kinds.pop()) if len(kinds) == 1 else None
            if method is not None and lin.in_features % 32 == 0:  # a TP shard may cut inside a block
                lin.quantize(method, max_rows, "block")
                n += 1
        return n

    def cast_(self, dtype: torch.dtype) -> LlamaForCausalLM:
        """Every parameter and buffer to ``dtype`` in place (quantized copies and packed weights are
        kept as they are: cast before ``pack_linears``)."""
        if any(isinstance(m, Linear) and m._packed is not None for m in self.modules()):
            raise RuntimeError("cast_ after pack_linears: the packed weights keep their dtype")
        self.to(dtype)
        self.dtype = dtype
        return self

    # ------------------------------------------------------------------ forward
    def forward(
        self, forward_batch: ForwardBatch, kv_pool: KVPool, req_to_token_pool: ReqToTokenPool
    ) -> torch.Tensor:
        """Logits ``[B, vocab]`` (model dtype) of each request's last new token."""
        hidden = self.forward_hidden(forward_batch, kv_pool, req_to_token_pool)
        return self.compute_logits(hidden, forward_batch)

    def forward_hidden(
        self, forward_batch: ForwardBatch, kv_pool: KVPool, req_to_token_pool: ReqToTokenPool
    ) -> torch.Tensor:
        """Final hidden states ``[T, hidden]`` of every new token, before the final norm."""
        fb = forward_batch
        backend = self.attn_backend
        backend.init_forward_metadata(fb, req_to_token_pool)
        positions = fb.positions
        cos = self.cos_cache.index_select(0, positions)  # [T, D/2]
        sin = self.sin_cache.index_select(0, positions)
        h = F.embedding(fb.input_ids, self.embed_tokens) if self.tp is None else self._embed_sharded(fb.input_ids)
        ops = self.small_ops
        if not ops.fused:  # the reference: each layer as HF writes it
            for layer in self.layers:
                h = layer(h, cos, sin, backend, fb, kv_pool, req_to_token_pool)
            return h
        layers = [layer for layer in self.layers if isinstance(layer, DecoderLayer)]
        first = layers[0].input_layernorm
        x = ops.rms_norm(h, first.weight, first.eps)  # h: a fresh tensor, the residual stream from here
        for i, layer in enumerate(layers):
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else None
            x = layer.forward_fused(x, h, nxt, ops, cos, sin, backend, fb, kv_pool, req_to_token_pool)
        return h

    def set_small_ops(self, name: str) -> None:
        """``"torch"`` (the reference), ``"cpp"`` (raises if its extension cannot be built) or
        ``"auto"``; see fused_ops.py."""
        self.small_ops = make_small_ops(name)

    def compute_logits(self, hidden: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        if forward_batch.is_decode_only:
            last = hidden
        else:
            ends, s = [], 0
            for n in forward_batch.extend_seq_lens:
                s += n
                ends.append(s - 1)
            last = hidden.index_select(0, torch.tensor(ends, dtype=torch.int64))
        normed = self.norm(last, self.small_ops)
        if self.tp is None:
            return self.lm_head(normed)
        # rank 0 gets every rank's slice side by side; the padding columns past the vocabulary go
        logits = self.tp.gather_last_dim(self.lm_head(normed))
        return logits[:, : self.config.vocab_size]

    def _embed_sharded(self, ids: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel lookup: rows of other ranks' tokens are zeros here, and the
        all-reduce adds the one rank's real row to them (exactly: every other term is 0)."""
        assert self.tp is not None
        v0, v1 = self.vocab_range
        outside = (ids < v0) | (ids >= v1)
        h = F.embedding((ids - v0).masked_fill_(outside, 0), self.embed_tokens)
        return self.tp.all_reduce_(h.masked_fill_(outside.unsqueeze(-1), 0.0))
