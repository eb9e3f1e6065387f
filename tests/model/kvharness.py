"""A minimal stand-in for the scheduler in model tests: owns request slots and KV slots, and builds
``ForwardBatch`` objects for prefill / extend-with-prefix / decode steps."""

from __future__ import annotations

import torch

from radixserve.mem.forward_batch import ForwardBatch, SamplingBatchInfo
from radixserve.mem.kv_pool import KVPool, ReqToTokenPool


class Harness:
    def __init__(
        self, kv_pool: KVPool, r2t: ReqToTokenPool, shuffle_slots: bool = True, seed: int = 0
    ) -> None:
        self.kv_pool = kv_pool
        self.r2t = r2t
        first = kv_pool.page_size  # the first page is the reserved padding target
        slots = torch.arange(first, first + kv_pool.size)
        if shuffle_slots:  # non-contiguous KV: makes the gather path do real work
            slots = slots[torch.randperm(kv_pool.size, generator=torch.Generator().manual_seed(seed))]
        self.free_slots: list[int] = slots.tolist()
        self.lens: dict[int, int] = {}  # req slot -> tokens in KV
        self.shared: dict[int, int] = {}  # req slot -> leading tokens borrowed from another request

    def new_request(self) -> int:
        idx = self.r2t.alloc()
        assert idx is not None
        self.lens[idx] = 0
        return idx

    def fork(self, src: int, n: int) -> int:
        """A new request whose first ``n`` tokens reuse ``src``'s KV slots (a radix-cache hit)."""
        idx = self.new_request()
        self.r2t.req_to_token[idx, :n] = self.r2t.req_to_token[src, :n]
        self.lens[idx] = n
        self.shared[idx] = n
        return idx

    def free_request(self, idx: int) -> None:
        n = self.lens.pop(idx)
        start = self.shared.pop(idx, 0)
        self.free_slots.extend(self.r2t.req_to_token[idx, start:n].tolist())
        self.r2t.free(idx)

    def batch(
        self,
        reqs: list[int],
        new_tokens: list[list[int]],
        sampling: SamplingBatchInfo | None = None,
        capture_logits: bool = True,
    ) -> ForwardBatch:
        """Extend each request by its new tokens (after whatever it already has in KV)."""
        ids, pos, locs, prefix, ext = [], [], [], [], []
        for r, toks in zip(reqs, new_tokens, strict=True):
            p = self.lens[r]
            slots = [self.free_slots.pop() for _ in toks]
            self.r2t.write(r, p, slots)
            ids += toks
            pos += range(p, p + len(toks))
            locs += slots
            prefix.append(p)
            ext.append(len(toks))
            self.lens[r] = p + len(toks)
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(pos, dtype=torch.int64),
            out_cache_loc=torch.tensor(locs, dtype=torch.int64),
            req_pool_indices=torch.tensor(reqs, dtype=torch.int64),
            seq_lens=torch.tensor([self.lens[r] for r in reqs], dtype=torch.int64),
            extend_prefix_lens=prefix,
            extend_seq_lens=ext,
            sampling=sampling or SamplingBatchInfo.greedy(len(reqs)),
            capture_logits=capture_logits,
        )
