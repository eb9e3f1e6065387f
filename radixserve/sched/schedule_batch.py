"""``ScheduleBatch``: the requests of one step, their mode, and how it becomes a ``ForwardBatch``."""

from __future__ import annotations

from enum import Enum, auto

import torch

from radixserve.mem.forward_batch import ForwardBatch, SamplingBatchInfo
from radixserve.sched.req import Req


class ForwardMode(Enum):
    EXTEND = auto()  # prefill / chunk of a prompt (possibly after a cached prefix)
    DECODE = auto()  # one new token per request
    MIXED = auto()  # extends and decodes in one forward (the unified scheduler's steps)
    IDLE = auto()  # nothing to run

    def is_extend(self) -> bool:
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED)

    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE


class ScheduleBatch:
    def __init__(self, reqs: list[Req] | None = None, forward_mode: ForwardMode = ForwardMode.DECODE) -> None:
        self.reqs: list[Req] = list(reqs or [])
        self.forward_mode = forward_mode
        # filled by the scheduler when it allocates this step's KV
        self.extend_lens: list[int] = []
        self.prefix_lens: list[int] = []
        self.out_slots: list[int] = []

    def __len__(self) -> int:
        return len(self.reqs)

    def is_empty(self) -> bool:
        return not self.reqs

    def filter(self, keep: list[Req]) -> None:
        self.reqs = keep

    def merge(self, other: ScheduleBatch) -> None:
        self.reqs.extend(other.reqs)

    def to_forward_batch(self, capture_logits: bool = False) -> ForwardBatch:
        ids: list[int] = []
        positions: list[int] = []
        for req, start, n in zip(self.reqs, self.prefix_lens, self.extend_lens, strict=True):
            k = req.prompt_len
            if start >= k:  # decode, or recompute within the outputs
                ids.extend(req.output_ids[start - k : start - k + n])
            elif start + n <= k:
                ids.extend(req.origin_input_ids[start : start + n])
            else:
                ids.extend(req.origin_input_ids[start:])
                ids.extend(req.output_ids[: start + n - k])
            positions.extend(range(start, start + n))
        sp = [r.sampling_params for r in self.reqs]
        seq_lens = [s + n for s, n in zip(self.prefix_lens, self.extend_lens, strict=True)]
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            out_cache_loc=torch.tensor(self.out_slots, dtype=torch.int64),
            req_pool_indices=torch.tensor([r.req_pool_idx for r in self.reqs], dtype=torch.int64),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
            extend_prefix_lens=list(self.prefix_lens),
            extend_seq_lens=list(self.extend_lens),
            sampling=SamplingBatchInfo(
                temperatures=[p.temperature for p in sp],
                top_ps=[p.top_p for p in sp],
                top_ks=[p.top_k for p in sp],
                min_ps=[p.min_p for p in sp],
                seeds=[p.seed for p in sp],
                steps=[len(r.output_ids) for r in self.reqs],
                return_logprob=[p.logprobs for p in sp],
                top_logprobs_nums=[p.top_logprobs_num for p in sp],
            ),
            capture_logits=capture_logits,
        )
