"""``torch_native``: attention in plain PyTorch (the reference backend, and the one with sliding
windows and soft-capped scores). The backend contract and the registry are ``attention_backend.py``'s.

Prefill and extend rows attend with one SDPA call per request over its cached and new KV. Decode
rows are gathered in chunks of at most ``DECODE_CHUNK_BYTES`` of K/V and attended together; rows
that share a cached prefix are grouped (``cascade.py``) so the prefix is read once.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from radixserve.mem.draft_tree import depths, is_chain, path_to
from radixserve.mem.forward_batch import ForwardBatch
from radixserve.mem.kv_pool import KVPool, ReqToTokenPool
from radixserve.model.attention_backend import AttentionBackend, register_attention_backend
from radixserve.model.cascade import SharedPrefixGroup, attend_shared, build_group, find_shared_prefixes

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------
# Pure PyTorch
# ---------------------------------------------------------------------------------------------------


# Decode requests are attended in chunks whose gathered K+V (float32) stay around this size: the
# chunk is gathered and consumed while still in L2/L3 (measured ~10-15% faster per step than one
# batch-wide gather at batch 64 x 256 tokens), and a chunk only pads to its own longest request.
DECODE_CHUNK_BYTES = 4 << 20


@dataclass
class _DecodeChunk:
    """Some decode requests attended by one SDPA call over a padded ``[n, L]`` gather."""

    start: int  # rows [start, end) of the decode group, in length-sorted order
    end: int
    rows: torch.Tensor | None  # their rows in the decode group when sorting moved them; else None
    gather: torch.Tensor  # [n * L] KV slots, padded with slot 0 (the reserved padding page)
    valid: torch.Tensor | None  # [n, 1, 1, L] bool; None when all n requests have length L
    max_len: int
    masks: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)  # additive masks by dtype

    def mask(self, dtype: torch.dtype) -> torch.Tensor | None:
        if self.valid is None:
            return None
        m = self.masks.get(dtype)
        if m is None:
            m = torch.zeros(self.valid.shape, dtype=dtype).masked_fill_(~self.valid, float("-inf"))
            self.masks[dtype] = m
        return m


@dataclass
class _DecodeGroup:
    """The requests of a batch with one new token each."""

    token_idx: torch.Tensor | None  # their tokens in the flat batch; None: all tokens, in order
    batch: int
    chunks: list[_DecodeChunk]
    max_rows: int  # largest n * L over the chunks (gather scratch size)


@dataclass
class _Extend:
    """One request with several new tokens: its own SDPA call."""

    start: int  # its tokens are [start, end) of the flat batch
    end: int
    prefix_len: int
    kv_idx: torch.Tensor | None  # [prefix + n] KV slots; None when there is no prefix (use the new k/v)
    mask: torch.Tensor | None  # [n, prefix + n] bool; None: plain causal


@dataclass
class _Metadata:
    batch_id: int
    decode: _DecodeGroup | None
    extends: list[_Extend]
    shared: list[tuple[torch.Tensor, SharedPrefixGroup]]  # (their tokens in the flat batch, group)
    fresh_extends: bool = False  # an extend without a cached prefix attends to the new k/v directly


@register_attention_backend("torch_native")
class TorchNativeAttention(AttentionBackend):
    """``torch.nn.functional.scaled_dot_product_attention`` over KV gathered from the pool.

    Decode requests (extend length 1) are sorted by length and cut into chunks of ~4 MB of KV; each
    chunk is one gather into a reused ``[n * L_max]`` buffer plus one SDPA call, so there is no
    per-request Python loop. GQA needs no repeat: the query heads of a KV head become the "query
    length" dimension (``q: [n, KVH, G, D]`` against ``k: [n, KVH, L, D]``). Requests with longer
    extends are looped, one SDPA call each, with a causal mask offset by their cached prefix.
    Decode requests that share a long enough prefix of KV slots (radix cache hits) are attended as
    groups that read the prefix once (``cascade.py``); ``share_prefixes = False`` turns that off.

    With a ``window`` a decode row gathers only its last ``window`` positions and an extend's mask
    also hides what lies before each token's window (the pool still holds those positions); with
    ``softcap`` the scores are computed, capped and normalized here, as transformers' eager
    attention does, instead of by SDPA.
    """

    has_windows = True
    has_softcap = True

    def _init_state(self) -> None:
        self._meta: _Metadata | None = None
        # decode requests that share a cached prefix read it once per group (see cascade.py); its
        # merged softmax has neither windows nor capping
        self.share_prefixes = not (self.window or self.softcap)
        self._gather_bufs: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def init_forward_metadata(self, forward_batch: ForwardBatch, req_to_token_pool: ReqToTokenPool) -> None:
        self._meta = self._build_metadata(forward_batch, req_to_token_pool)

    def _build_metadata(self, fb: ForwardBatch, r2t_pool: ReqToTokenPool) -> _Metadata:
        r2t = r2t_pool.req_to_token
        ext_lens = fb.extend_seq_lens
        prefix_lens = fb.extend_prefix_lens
        rpi_list = fb.req_pool_indices.tolist()
        # Rows attended one token at a time: decode rows, and each position of a speculative verify
        # row as the decode row it would have been (its prefix grown by the drafts before it), so
        # that verifying a token computes what decoding it would have.
        by_token = set(fb.verify.rows) if fb.verify is not None else set()
        trees = dict(zip(fb.verify.rows, fb.verify.parents, strict=True)) if fb.verify and fb.verify.parents else {}
        dec_tok: list[int] = []  # their tokens in the flat batch
        dec_rpi: list[int] = []
        lens: list[int] = []
        start = 0
        for i, n in enumerate(ext_lens):
            if n == 1 or i in by_token:
                tree = trees.get(i)
                heights = [0, *depths(tree)] if tree is not None else range(n)
                for j in range(n):
                    dec_tok.append(start + j)
                    dec_rpi.append(rpi_list[i])
                    lens.append(prefix_lens[i] + heights[j] + 1)
            start += n
        decode: _DecodeGroup | None = None
        shared: list[tuple[torch.Tensor, SharedPrefixGroup]] = []
        dec_table = r2t
        if any(not is_chain(t) for t in trees.values()):
            dec_table, dec_rpi = self._tree_rows(fb, r2t, dec_tok, dec_rpi, lens, trees)
        if dec_tok:
            all_decode = len(dec_tok) == start  # every token, in order
            grouped: set[int] = set()
            if self.share_prefixes and len(dec_tok) > 1:
                for members, p in find_shared_prefixes(dec_table, dec_rpi, lens):
                    grp = build_group(dec_table, dec_rpi, lens, members, p)
                    tok = torch.tensor([dec_tok[m] for m in members], dtype=torch.int64)
                    shared.append((tok, grp))
                    grouped.update(members)
            rest = [j for j in range(len(dec_tok)) if j not in grouped]
            if rest:
                token_idx: torch.Tensor | None = None
                if all_decode and not grouped:
                    rows_rpi = torch.tensor(dec_rpi, dtype=torch.int64) if by_token else fb.req_pool_indices
                else:
                    token_idx = torch.tensor([dec_tok[j] for j in rest], dtype=torch.int64)
                    rows_rpi = torch.tensor([dec_rpi[j] for j in rest], dtype=torch.int64)
                rest_lens = [lens[j] for j in rest]
                if self.window and max(rest_lens) > self.window:
                    decode = self._window_decode_group(dec_table, rows_rpi, rest_lens, token_idx, self.window)
                else:
                    decode = self._decode_group(dec_table, rows_rpi, rest_lens, token_idx)
        extends: list[_Extend] = []
        start = 0
        for i, n in enumerate(ext_lens):
            if n != 1 and i not in by_token:
                p = prefix_lens[i]
                kv_idx = mask = None
                if p > 0:
                    kv_idx = r2t[rpi_list[i], : p + n]
                if p > 0 or (self.window and n > self.window):
                    key_pos, query_pos = torch.arange(p + n).unsqueeze(0), (torch.arange(n) + p).unsqueeze(1)
                    mask = key_pos <= query_pos
                    if self.window:
                        mask &= key_pos > query_pos - self.window
                extends.append(_Extend(start, start + n, p, kv_idx, mask))
            start += n
        return _Metadata(id(fb), decode, extends, shared, any(ext.kv_idx is None for ext in extends))

    @staticmethod
    def _tree_rows(fb: ForwardBatch, r2t: torch.Tensor, dec_tok: list[int], dec_rpi: list[int], lens: list[int],
                   trees: dict[int, list[int]]) -> tuple[torch.Tensor, list[int]]:
        """A table with one row per token attended token by token, for a step whose drafts branch:
        a draft's row is its request's prefix and last token, then the slots of its ancestors and
        its own (where the request's row holds its siblings' drafts in draft order). Returns it and
        each token's row in it."""
        table = r2t.index_select(0, torch.tensor(dec_rpi, dtype=torch.int64))[:, : max(lens)].clone()
        loc = fb.out_cache_loc.tolist()
        row_of = {t: j for j, t in enumerate(dec_tok)}
        start = 0
        for i, n in enumerate(fb.extend_seq_lens):
            tree = trees.get(i)
            if tree is not None:
                base = fb.extend_prefix_lens[i] + 1  # the first draft's position
                for d in range(len(tree)):
                    path = path_to(tree, d)
                    slots = torch.tensor([loc[start + 1 + a] for a in path], dtype=table.dtype)
                    table[row_of[start + 1 + d], base : base + len(path)] = slots
            start += n
        return table, list(range(len(dec_tok)))

    def _decode_group(
        self, r2t: torch.Tensor, rows_rpi: torch.Tensor, lens: list[int], token_idx: torch.Tensor | None
    ) -> _DecodeGroup:
        B = len(lens)
        order = sorted(range(B), key=lambda i: -lens[i])  # longest first: chunks pad less
        sorted_ok = all(lens[order[i]] == lens[i] for i in range(B))  # already in that order
        token_bytes = 2 * self.num_kv_heads * self.head_dim * 4
        chunks: list[_DecodeChunk] = []
        s = 0
        while s < B:
            L = lens[order[s]]
            e = min(B, s + max(1, DECODE_CHUNK_BYTES // (L * token_bytes)))
            rows = None if sorted_ok else torch.tensor(order[s:e], dtype=torch.int64)
            rpi = rows_rpi[s:e] if rows is None else rows_rpi.index_select(0, rows)
            idx = r2t[:, :L].index_select(0, rpi)  # [n, L]: only the needed columns
            chunk_lens = [lens[i] for i in order[s:e]]
            valid = None
            if chunk_lens[-1] != L:
                keep = torch.arange(L).unsqueeze(0) < torch.tensor(chunk_lens).unsqueeze(1)
                idx = idx.masked_fill(~keep, 0)
                valid = keep.view(e - s, 1, 1, L)
            chunks.append(_DecodeChunk(s, e, rows, idx.reshape(-1).contiguous(), valid, L))
            s = e
        max_rows = max((c.end - c.start) * c.max_len for c in chunks)
        return _DecodeGroup(token_idx, B, chunks, max_rows)

    def _window_decode_group(
        self, r2t: torch.Tensor, rows_rpi: torch.Tensor, lens: list[int], token_idx: torch.Tensor | None,
        window: int,
    ) -> _DecodeGroup:
        """Decode rows that attend their last ``window`` positions, ``[len - window, len)``: one
        chunk (the window bounds its size), padded to the longest span."""
        firsts = [max(0, n - window) for n in lens]
        spans = [n - f for n, f in zip(lens, firsts, strict=True)]
        L = max(spans)
        cols = torch.tensor(firsts).unsqueeze(1) + torch.arange(L).unsqueeze(0)  # [B, L]
        keep = torch.arange(L).unsqueeze(0) < torch.tensor(spans).unsqueeze(1)
        idx = r2t.index_select(0, rows_rpi).gather(1, cols.clamp_(max=r2t.shape[1] - 1)).masked_fill_(~keep, 0)
        valid = None if all(s == L for s in spans) else keep.view(len(lens), 1, 1, L)
        chunk = _DecodeChunk(0, len(lens), None, idx.reshape(-1).contiguous(), valid, L)
        return _DecodeGroup(token_idx, len(lens), [chunk], len(lens) * L)

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool
    ) -> torch.Tensor:
        """SDPA, or, with a soft cap, the same computed here (``q: [.., H, n, D]``, ``k, v: [.., KVH,
        L, D]``; ``mask``: bool (True = attend) or additive)."""
        if self.softcap is None:
            gqa = q.shape[-3] != k.shape[-3]
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=self.scaling,
                                                  enable_gqa=gqa)
        if q.shape[-3] != k.shape[-3]:
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
            v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scaling
        scores = torch.tanh(scores / self.softcap) * self.softcap
        if causal:
            n, L = scores.shape[-2:]
            mask = torch.ones(n, L, dtype=torch.bool).tril_(L - n)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        forward_batch: ForwardBatch,
        kv_pool: KVPool,
        req_to_token_pool: ReqToTokenPool,
    ) -> torch.Tensor:
        meta = self._meta
        if meta is None or meta.batch_id != id(forward_batch):
            meta = self._meta = self._build_metadata(forward_batch, req_to_token_pool)
        loc = forward_batch.out_cache_loc
        self._store(kv_pool, layer_id, loc, k, v)
        if kv_pool.format.quantized and meta.fresh_extends:
            # the new tokens as stored: a prompt attends to the same K/V with or without a cached prefix
            k, v = kv_pool.read(layer_id, loc, q.dtype)

        T, H, D = q.shape
        G = self.group
        dec = meta.decode
        if dec is not None and dec.token_idx is None:  # decode-only batch: no scatter needed
            return self._decode(q, dec, kv_pool, layer_id)
        out = q.new_empty(T, H * D)
        for tok, grp in meta.shared:
            qs = q.index_select(0, tok).view(len(grp.members), self.num_kv_heads, G, D)
            out.index_copy_(0, tok, attend_shared(qs, grp, functools.partial(kv_pool.read, layer_id, dtype=q.dtype),
                                                  self.scaling))
        if dec is not None:
            assert dec.token_idx is not None
            o = self._decode(q.index_select(0, dec.token_idx), dec, kv_pool, layer_id)
            out.index_copy_(0, dec.token_idx, o)
        for ext in meta.extends:
            n = ext.end - ext.start
            qe = q[ext.start : ext.end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            if ext.kv_idx is None:
                ke = k[ext.start : ext.end]
                ve = v[ext.start : ext.end]
            else:
                ke, ve = kv_pool.read(layer_id, ext.kv_idx, q.dtype)
            ke = ke.to(q.dtype).transpose(0, 1).unsqueeze(0)  # [1, KVH, L, D]
            ve = ve.to(q.dtype).transpose(0, 1).unsqueeze(0)
            o = self._attend(qe, ke, ve, ext.mask, causal=ext.mask is None)
            out[ext.start : ext.end] = o.squeeze(0).transpose(0, 1).reshape(n, H * D)
        return out

    def _store(self, kv_pool: KVPool, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the new tokens' K/V into the pool (a backend with a faster way overrides it)."""
        kv_pool.write(layer_id, loc, k, v)

    def _scratch(self, rows: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather destinations kept across layers and forwards: a fresh multi-MB tensor per call
        costs page faults (glibc serves big blocks with mmap); measured, that doubled gather time."""
        k, v = self._gather_bufs.get(like.dtype, (None, None))
        if k is None or v is None or k.shape[0] < rows:
            shape = (rows, *like.shape[1:])
            k, v = like.new_empty(shape), like.new_empty(shape)
            self._gather_bufs[like.dtype] = (k, v)
        return k, v

    def _decode(self, q: torch.Tensor, dec: _DecodeGroup, kv_pool: KVPool, layer_id: int) -> torch.Tensor:
        B = dec.batch
        KVH, G, D = self.num_kv_heads, self.group, self.head_dim
        qg = q.reshape(B, KVH, G, D)  # the G query heads sharing a KV head act as G query rows
        k_buf, v_buf = kv_pool.k_buffers[layer_id], kv_pool.v_buffers[layer_id]
        quantized = kv_pool.format.quantized
        if not quantized:
            k_scratch, v_scratch = self._scratch(dec.max_rows, k_buf)
        out = q.new_empty(B, KVH * G * D)
        for c in dec.chunks:
            n, L = c.end - c.start, c.max_len
            if quantized:
                kg, vg = kv_pool.read(layer_id, c.gather, q.dtype)
            else:
                kg, vg = k_scratch[: n * L], v_scratch[: n * L]
                torch.index_select(k_buf, 0, c.gather, out=kg)
                torch.index_select(v_buf, 0, c.gather, out=vg)
            kt = kg.view(n, L, KVH, D).transpose(1, 2)  # [n, KVH, L, D]
            vt = vg.view(n, L, KVH, D).transpose(1, 2)
            if kt.dtype != q.dtype:
                kt, vt = kt.to(q.dtype), vt.to(q.dtype)
            qc = qg[c.start : c.end] if c.rows is None else qg.index_select(0, c.rows)
            o = self._attend(qc, kt, vt, c.mask(q.dtype), causal=False)
            if c.rows is None:
                out[c.start : c.end] = o.reshape(n, KVH * G * D)
            else:
                out.index_copy_(0, c.rows, o.reshape(n, KVH * G * D))
        return out


def _starts(lens: list[int]) -> list[int]:
    out, s = [], 0
    for n in lens:
        out.append(s)
        s += n
    return out
