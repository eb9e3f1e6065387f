"""The draft side of speculative decoding with a draft model (``--speculative-algorithm draft``).

A smaller model (``--speculative-draft-model-path``; by default the target's own GGUF read in its
4-bit blocks, a cheap draft of a float or bfloat16 target) proposes ``k`` tokens greedily, one
forward per token, and the target verifies them in one forward (``spec_verify.py``). The scheduler
asks for ``k`` drafts per row and takes the step's KV slots for them, as for n-gram drafts; the
runner fills the draft tokens in (``ForwardBatch.verify`` with ``by_runner``).

Its KV lives in a pool of its own shape indexed by the same slots as the target's (one allocator,
one request table, one radix cache): slot ``s`` holds the target's KV of a token in the target's
pool and the draft's KV of the same token in the draft's. The draft does not run on every
forward; two arrays say what it holds:

- ``slot_token[s]``: the token whose KV the target last wrote at ``s`` (every forward records it);
- ``valid[s]``: whether the draft's KV at ``s`` is of that token (cleared where the target writes
  without the draft, set where the draft writes).

The draft runs on every forward that carries a prompt (chunk), so prompts are read once, at
prefill, and decode steps that draft stay short. Before drafting for a row whose context is at
position ``p``, the first position ``q`` of its context that is not valid is found, and the first
draft forward extends the row from ``q`` with the recorded tokens (``q == p`` but after decode
steps without drafts, for a cached prefix the draft never saw, or after the last draft of a fully
accepted step): the draft catches up on what it missed in the same forward that makes its first
draft token. Cached prefixes shared through the radix cache carry their
draft KV along. Drafts from stale KV could only be worse drafts, never wrong outputs: the target
decides every token.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from radixserve.mem.forward_batch import ForwardBatch, SamplingBatchInfo
from radixserve.mem.kv_pool import KVPool, ReqToTokenPool


class DraftRunner(Protocol):
    """What the draft side needs of the draft model's ``ModelRunner``."""

    model: Any

    def kv_bytes_per_token(self) -> int: ...

    def make_kv_pool(self, size: int, page_size: int = 1) -> KVPool: ...


class DraftModel:
    def __init__(self, runner: DraftRunner) -> None:
        """``runner``: a ``ModelRunner`` of the draft model (its model, its KV pool once attached)."""
        self.runner = runner
        self.kv_pool: KVPool | None = None
        self.slot_token = torch.zeros(0, dtype=torch.int64)
        self.valid = torch.zeros(0, dtype=torch.bool)

    def kv_bytes_per_token(self) -> int:
        return self.runner.kv_bytes_per_token()

    def attach(self, target_pool: KVPool) -> None:
        """Make the draft's KV pool with the target's slots (size and page size)."""
        self.kv_pool = self.runner.make_kv_pool(target_pool.size, target_pool.page_size)
        rows = target_pool.k_buffers[0].shape[0]
        self.slot_token = torch.zeros(rows, dtype=torch.int64)
        self.valid = torch.zeros(rows, dtype=torch.bool)

    def target_wrote(self, slots: list[int], tokens: list[int]) -> None:
        """The target's KV of ``tokens`` reached ``slots`` without a forward (a KV transfer): record
        the tokens; the draft lacks them until it catches up."""
        idx = torch.tensor(slots, dtype=torch.int64)
        self.slot_token[idx] = torch.tensor(tokens, dtype=torch.int64)
        self.valid[idx] = False

    @torch.inference_mode()
    def before_target(self, fb: ForwardBatch, r2t: ReqToTokenPool) -> None:
        """Every forward, before the target runs: draft the rows that want it (filling their input
        ids and ``fb.verify.drafts``), then record what the target writes and what the draft holds."""
        written = None
        if fb.verify is not None and fb.verify.by_runner:
            written = self._propose(fb, r2t)
        elif not fb.is_decode_only:  # a prompt (chunk): the draft reads it now, not in a later decode step
            self.runner.model(fb, self.kv_pool, r2t)
            written = fb.out_cache_loc
        loc = fb.out_cache_loc
        self.slot_token[loc] = fb.input_ids
        self.valid[loc] = False
        if written is not None:
            self.valid[written] = True

    def _propose(self, fb: ForwardBatch, r2t: ReqToTokenPool) -> torch.Tensor:
        """Greedy drafts for ``fb.verify``'s rows; returns the slots whose draft KV it wrote."""
        assert fb.verify is not None and self.kv_pool is not None
        v = fb.verify
        starts, s = [], 0
        for n in fb.extend_seq_lens:
            starts.append(s)
            s += n
        rows = v.rows
        ks = [len(d) for d in v.drafts]
        flat = [starts[r] for r in rows]
        pos = [int(fb.positions[f]) for f in flat]  # each row's last token's position
        pool_rows = [int(fb.req_pool_indices[r]) for r in rows]
        # the first draft forward: catch up from each row's first position the draft lacks
        ids, positions, locs, prefix, ext = [], [], [], [], []
        written = []
        for f, p, row in zip(flat, pos, pool_rows, strict=True):
            slots = r2t.req_to_token[row, :p]
            bad = (~self.valid[slots]).nonzero()
            q = int(bad[0]) if bad.numel() else p
            ids.append(self.slot_token[slots[q:]])
            ids.append(fb.input_ids[f : f + 1])
            locs.append(slots[q:])
            locs.append(fb.out_cache_loc[f : f + 1])
            positions.append(torch.arange(q, p + 1))
            prefix.append(q)
            ext.append(p + 1 - q)
        tokens = self._forward(torch.cat(ids), torch.cat(positions), torch.cat(locs), pool_rows, prefix, ext, r2t)
        written.extend(locs)
        drafts: list[list[int]] = [[t] for t in tokens]
        for j in range(1, max(ks)):
            live = [i for i, k in enumerate(ks) if k > j]
            # draft token j at position p + j, into the slot the scheduler took for it
            loc = torch.stack([fb.out_cache_loc[flat[i] + j] for i in live])
            tokens = self._forward(torch.tensor([drafts[i][-1] for i in live], dtype=torch.int64),
                                   torch.tensor([pos[i] + j for i in live], dtype=torch.int64), loc,
                                   [pool_rows[i] for i in live], [pos[i] + j for i in live], [1] * len(live), r2t)
            written.append(loc)
            for i, t in zip(live, tokens, strict=True):
                drafts[i].append(t)
        for i, (f, k) in enumerate(zip(flat, ks, strict=True)):
            d = drafts[i][:k]
            v.drafts[i] = d
            fb.input_ids[f + 1 : f + 1 + k] = torch.tensor(d, dtype=torch.int64)
        return torch.cat(written)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, locs: torch.Tensor, pool_rows: list[int],
                 prefix: list[int], ext: list[int], r2t: ReqToTokenPool) -> list[int]:
        """One draft forward; the greedy next token of each row."""
        seq = [a + b for a, b in zip(prefix, ext, strict=True)]
        fb = ForwardBatch(ids, positions, locs, torch.tensor(pool_rows, dtype=torch.int64),
                          torch.tensor(seq, dtype=torch.int64), prefix, ext, SamplingBatchInfo.greedy(len(ext)))
        logits = self.runner.model(fb, self.kv_pool, r2t)
        return logits.argmax(dim=-1).tolist()
