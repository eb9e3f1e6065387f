"""Llama-family decoder (Llama, Mistral, Mixtral, Qwen2, Qwen3, Qwen3-MoE, Phi-3) in plain PyTorch,
over a paged KV pool. How the families differ, and which config fields say so: config.py.

The state dict stays in Hugging Face naming (``model.layers.N.self_attn.q_proj.weight``...), which is
what the loaders produce and what the parity tests feed to transformers. Every family's checkpoint
comes in one spelling (loader.py): q/k/v and gate/up as separate tensors, experts as Qwen3-MoE names
them (``mlp.gate``, ``mlp.experts.E.gate_proj``...). At build time q/k/v are fused into one
``qkv_proj`` and gate/up into one ``gate_up_proj`` (fewer, larger GEMMs).

The layers themselves (attention, MLP, routed experts, norms, RoPE) are in layers.py, the decoder
layer that strings them together with its norm layout in decoder_layer.py.

``forward`` consumes a ``ForwardBatch`` (flat new tokens of all requests) and returns the logits of
each request's last new token only: the LM head never runs on the other positions.

With a ``TPGroup`` (tensor parallelism, parallel.py) each rank builds and loads only its shard of
every layer; without one (``tp`` None) nothing of that runs: no collective, no masking.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.mem.forward_batch import ForwardBatch
from radixserve.mem.kv_pool import KVPool, ReqToTokenPool
from radixserve.model.attention_backend import AttentionBackend, create_attention_backend
from radixserve.model.config import ModelConfig
from radixserve.model.decoder_layer import NORMS, DecoderLayer
from radixserve.model.fused_ops import TorchOps, make_small_ops
from radixserve.model.gguf_blocks import GGUFBlocks, GGUFWeight, decode_rows
from radixserve.model.layers import MLP, RMSNorm, SparseMoE, rope_tables
from radixserve.model.linear import Linear, empty_param
from radixserve.model.parallel import TPGroup
from radixserve.model.quant import DEFAULT_MAX_ROWS
from radixserve.model.safetensors_loader import Weights


class _Source:
    """A state dict being loaded: the names taken from it, whole or cut to a shard."""

    def __init__(self, sd: Weights) -> None:
        self.sd = sd
        self.used: set[str] = set()

    def take(self, name: str) -> torch.Tensor | GGUFBlocks:
        if name not in self.sd:
            raise KeyError(f"state dict lacks {name}")
        self.used.add(name)
        return self.sd[name]

    def cut(self, name: str, index: Any) -> torch.Tensor | GGUFBlocks:
        """Rows or columns of ``name``: blocks where the cut keeps them whole, else as float."""
        w = self.take(name)
        if isinstance(w, GGUFBlocks):
            try:
                return w[index]
            except ValueError:  # columns inside blocks: this shard as float
                return w.dequantize()[index]
        return w[index]

    def floats(self, name: str) -> torch.Tensor:
        w = self.take(name)
        return w.dequantize() if isinstance(w, GGUFBlocks) else w


class LlamaForCausalLM(nn.Module):
    cos_cache: torch.Tensor
    sin_cache: torch.Tensor
    local_cos_cache: torch.Tensor | None
    local_sin_cache: torch.Tensor | None

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
        self.embed_blocks: GGUFBlocks | None = None  # the embedding kept in GGUF blocks (then embed_tokens is empty)
        self.layers = nn.ModuleList(DecoderLayer(config, i, dtype, tp) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_eps, dtype)
        self.lm_head = Linear(config.hidden_size, vocab_rows, False, dtype)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens
        tp_size = tp.size if tp else 1
        heads = (config.num_heads // tp_size, config.num_kv_heads // tp_size, config.head_dim)
        backend_name = attention_backend if isinstance(attention_backend, str) else None
        if isinstance(attention_backend, str):
            attention_backend = create_attention_backend(
                attention_backend, *heads, config.attention_multiplier, softcap=config.attn_softcap
            )
        self.attn_backend = attention_backend
        # the sliding-window layers' own backend (a second set of per-forward metadata)
        self.local_attn_backend: AttentionBackend | None = None
        if config.sliding_layers:
            self.local_attn_backend = create_attention_backend(
                backend_name or "auto", *heads, config.attention_multiplier, config.sliding_window,
                config.attn_softcap,
            )
        # the small per-layer ops go with the backend: the C++ ones where the backend is the C++ one
        self.small_ops: TorchOps = make_small_ops("auto" if attention_backend.fused_small_ops else "torch")
        cos, sin, local_cos, local_sin = rope_tables(config, context_len, dtype)
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)
        # the sliding layers' own RoPE base (Gemma 3); None: they share the tables above
        self.register_buffer("local_cos_cache", local_cos, persistent=False)
        self.register_buffer("local_sin_cache", local_sin, persistent=False)

    # ------------------------------------------------------------------ weights
    @classmethod
    def from_state_dict(
        cls,
        config: ModelConfig,
        state_dict: Weights,
        dtype: torch.dtype = torch.float32,
        attention_backend: str | AttentionBackend = "auto",
        tp: TPGroup | None = None,
        context_len: int | None = None,
    ) -> LlamaForCausalLM:
        model = cls(config, dtype, attention_backend, tp, context_len)
        model.load_weights(state_dict)
        return model.eval()

    @torch.no_grad()
    def load_weights(self, sd: Weights) -> None:
        """Copy an HF-named state dict in, fusing q/k/v and gate/up. Every parameter must be set.

        GGUF blocks stay blocks: a linear whose parts all are keeps them (``Linear.load``), the
        embedding is looked up from them; anything else (a norm, the MoE router) is dequantized.

        Under tensor parallelism the whole tensors come in and this rank's rows / columns are cut
        out here (every rank reads the whole checkpoint: fine for small models), blocks kept where
        the cut keeps them whole; the vocabulary-parallel embedding and LM head are dequantized."""
        src = _Source(sd)
        take, cut, floats, used = src.take, src.cut, src.floats, src.used

        c, D = self.config, self.config.head_dim
        tp_size, rank = (self.tp.size, self.tp.rank) if self.tp is not None else (1, 0)
        hq, hk = c.num_heads // tp_size, c.num_kv_heads // tp_size
        q_part, kv_part = slice(rank * hq * D, (rank + 1) * hq * D), slice(rank * hk * D, (rank + 1) * hk * D)
        v0, v1 = self.vocab_range

        def vocab_rows(dst: torch.Tensor, src: torch.Tensor) -> None:
            dst[: v1 - v0].copy_(src[v0:v1])
            dst[v1 - v0 :].zero_()  # padding of the last rank's slice: never looked up, its logits cut off

        emb = take("model.embed_tokens.weight")
        if isinstance(emb, GGUFBlocks) and self.tp is not None:
            emb = emb.dequantize()  # each rank holds a padded slice of the vocabulary
        if isinstance(emb, GGUFBlocks):
            self.embed_blocks = emb
            if c.tie_word_embeddings:
                self.lm_head.load([emb])
            self.embed_tokens = empty_param(0, c.hidden_size, dtype=self.dtype)
        else:
            vocab_rows(self.embed_tokens, emb)

        def norm_weight(name: str) -> torch.Tensor:
            w = floats(name)
            return w + c.norm_weight_offset if c.norm_weight_offset else w

        self.norm.weight.copy_(norm_weight("model.norm.weight"))
        if not c.tie_word_embeddings:
            head = take("lm_head.weight")
            if isinstance(head, GGUFBlocks) and self.tp is not None:
                head = head.dequantize()
            if isinstance(head, GGUFBlocks):
                self.lm_head.load([head])
            else:
                vocab_rows(self.lm_head.weight, head)
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, DecoderLayer)
            p = f"model.layers.{i}."
            a = layer.self_attn
            parts = (q_part, kv_part, kv_part)
            a.qkv_proj.load([cut(p + f"self_attn.{n}_proj.weight", r) for n, r in zip("qkv", parts, strict=True)])
            if a.qkv_proj.bias is not None:
                a.qkv_proj.bias.copy_(
                    torch.cat([floats(p + f"self_attn.{n}_proj.bias")[r] for n, r in zip("qkv", parts, strict=True)])
                )
            a.o_proj.load([cut(p + "self_attn.o_proj.weight", (slice(None), q_part))])
            if a.q_norm is not None and a.k_norm is not None:
                a.q_norm.weight.copy_(norm_weight(p + "self_attn.q_norm.weight"))
                a.k_norm.weight.copy_(norm_weight(p + "self_attn.k_norm.weight"))
            for role, hf_name in NORMS[c.norm_layout].items():
                getattr(layer, role).weight.copy_(norm_weight(p + hf_name + ".weight"))
            for mlp, prefix in self._mlps(layer, p):
                r0, r1 = mlp.rows
                mlp.gate_up_proj.load([cut(prefix + "gate_proj.weight", slice(r0, r1)),
                                       cut(prefix + "up_proj.weight", slice(r0, r1))])
                mlp.down_proj.load([cut(prefix + "down_proj.weight", (slice(None), slice(r0, r1)))])
            if isinstance(layer.mlp, SparseMoE):
                layer.mlp.gate.copy_(floats(p + "mlp.gate.weight"))
        unused = [
            k for k in sd if k not in used and not (k == "lm_head.weight" and c.tie_word_embeddings)
        ]
        if unused:
            raise ValueError(f"state dict has tensors this model does not use: {unused[:8]}")

    def set_block_rows(self, small_rows: int) -> None:
        """Inputs up to ``small_rows`` rows take the GGUF block kernel's row-at-a-time path."""
        for m in self.modules():
            if isinstance(m, Linear) and isinstance(m._quant, GGUFWeight):
                m._quant.small_rows = small_rows

    def pack_block_tiles(self) -> int:
        """Pack the GGUF weights the AMX int8 kernel takes (``GGUFWeight.pack_tiles``); how many."""
        return sum(m._quant.pack_tiles() for m in self.modules() if isinstance(m, Linear) and isinstance(m._quant, GGUFWeight))

    def weight_bytes(self) -> int:
        """Bytes of every weight the forward reads: parameters, GGUF blocks, packed and quantized copies
        (storage shared by two of them, as the tied embedding and LM head, counted once)."""
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        blocks = [t for m in linears if isinstance(m._quant, GGUFWeight) for t in (
            *(s.data for s in m._quant.segments), *m._quant.tiles)]
        if self.embed_blocks is not None:
            blocks.append(self.embed_blocks.data)
        sizes = {t.data_ptr(): t.numel() * t.element_size()
                 for t in [*self.parameters(), *self.buffers(), *blocks] if t.numel()}
        # oneDNN's packed weights (opaque: no data pointer) and int8/int4 copies are never shared
        packed = sum(m._packed.numel() * m._packed.element_size() for m in linears if m._packed is not None)
        copies = sum(m._quant.nbytes for m in linears if m._quant is not None and not isinstance(m._quant, GGUFWeight))
        return sum(sizes.values()) + packed + copies

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
        fb = forward_batch
        # a step verifying drafts, every other row a decode row: its rows take the bf16 GGUF kernel
        # its requests' decode rows would (gguf_blocks.decode_rows)
        verify = set(fb.verify.rows) if fb.verify is not None else set()
        decode_like = bool(verify) and all(n == 1 or i in verify for i, n in enumerate(fb.extend_seq_lens))
        with decode_rows(fb.batch_size) if decode_like else nullcontext():
            hidden = self.forward_hidden(fb, kv_pool, req_to_token_pool)
            return self.compute_logits(hidden, fb)

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
        # what each layer attends with: the sliding-window layers (Gemma) have their own backend,
        # and their own RoPE tables where the model has them
        full = local = (backend, cos, sin, fb, req_to_token_pool)
        if self.local_attn_backend is not None:
            # where the sliding layers have KV slots of their own (mem/window_kv.py), they write and
            # read there: the same batch with their slots, and the twin table
            local_fb, local_r2t = fb, req_to_token_pool
            wkv, twin = req_to_token_pool.window_kv, req_to_token_pool.window
            if wkv is not None and twin is not None:
                local_fb, local_r2t = replace(fb, out_cache_loc=wkv.translate(fb.out_cache_loc)), twin
            self.local_attn_backend.init_forward_metadata(local_fb, local_r2t)
            local = (self.local_attn_backend, cos, sin, local_fb, local_r2t)
        if self.local_cos_cache is not None and self.local_sin_cache is not None:
            local = (local[0], self.local_cos_cache.index_select(0, positions),
                     self.local_sin_cache.index_select(0, positions), local[3], local[4])
        layers = [layer for layer in self.layers if isinstance(layer, DecoderLayer)]
        if self.embed_blocks is not None:
            h = self.embed_blocks.lookup(fb.input_ids).to(self.dtype)
        elif self.tp is None:
            h = F.embedding(fb.input_ids, self.embed_tokens)
        else:
            h = self._embed_sharded(fb.input_ids)
        if self.config.embedding_multiplier != 1:
            h = h * self.config.embedding_multiplier
        ops = self.small_ops
        if not ops.fused or self.config.norm_layout != "pre":  # the reference: each layer as HF writes it
            for layer in layers:
                b, c, s, lfb, r2t = local if layer.sliding else full
                h = layer(h, c, s, b, lfb, kv_pool, r2t)
            return h
        norms = [layer.attn_norm for layer in layers if layer.attn_norm is not None]
        assert len(norms) == len(layers)  # pre-norm layers (the others took the branch above)
        x = ops.rms_norm(h, norms[0].weight, norms[0].eps)  # h: a fresh tensor, the residual stream from here
        for i, layer in enumerate(layers):
            nxt = norms[i + 1] if i + 1 < len(layers) else None
            b, c, s, lfb, r2t = local if layer.sliding else full
            x = layer.forward_fused(x, h, nxt, ops, c, s, b, lfb, kv_pool, r2t)
        return h

    def set_small_ops(self, name: str) -> None:
        """``"torch"`` (the reference), ``"cpp"`` (raises if its extension cannot be built) or
        ``"auto"``; see fused_ops.py."""
        self.small_ops = make_small_ops(name)

    def compute_logits(self, hidden: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        """Logits of each request's last token, then (rows ``B..``) of the positions in
        ``forward_batch.extra_logit_positions()`` (prompt logprobs, draft verification)."""
        fb = forward_batch
        if fb.is_decode_only and fb.prompt_logprobs is None and fb.verify is None:
            last = hidden
        else:
            ends, s = [], 0
            for n in fb.extend_seq_lens:
                s += n
                ends.append(s - 1)
            ends.extend(fb.extra_logit_positions())
            last = hidden.index_select(0, torch.tensor(ends, dtype=torch.int64))
        normed = self.norm(last, self.small_ops)
        if self.tp is None:
            logits = self.lm_head(normed)
        else:  # rank 0 gets every rank's slice side by side; the padding columns past the vocabulary go
            logits = self.tp.gather_last_dim(self.lm_head(normed))[:, : self.config.vocab_size]
        scale, cap = self.config.logits_scaling, self.config.final_softcap
        if scale != 1:
            logits = logits / scale
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _embed_sharded(self, ids: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel lookup: rows of other ranks' tokens are zeros here, and the
        all-reduce adds the one rank's real row to them (exactly: every other term is 0)."""
        assert self.tp is not None
        v0, v1 = self.vocab_range
        outside = (ids < v0) | (ids >= v1)
        h = F.embedding((ids - v0).masked_fill_(outside, 0), self.embed_tokens)
        return self.tp.all_reduce_(h.masked_fill_(outside.unsqueeze(-1), 0.0))
