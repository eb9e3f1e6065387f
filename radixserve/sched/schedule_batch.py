"""``ScheduleBatch``: the requests of one step, their mode, and how it becomes a ``ForwardBatch``."""

from __future__ import annotations

from enum import Enum, auto
from operator import attrgetter

from radixserve.mem.forward_batch import ForwardBatch, SamplingBatchInfo, int64_tensor
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
        if self.forward_mode is ForwardMode.DECODE:
            return self._decode_forward_batch(capture_logits)
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
        seq_lens = [s + n for s, n in zip(self.prefix_lens, self.extend_lens, strict=True)]
        return self._make(ids, positions, seq_lens, capture_logits)

    def _decode_forward_batch(self, capture_logits: bool) -> ForwardBatch:
        """One token per request at position ``prefix_len``: the same batch as the general path."""
        ids: list[int] = []
        append = ids.append
        for req, start in zip(self.reqs, self.prefix_lens, strict=True):
            k = len(req.origin_input_ids)
            append(req.output_ids[start - k] if start >= k else req.origin_input_ids[start])
        return self._make(ids, self.prefix_lens, [s + 1 for s in self.prefix_lens], capture_logits)

    def _make(self, ids: list[int], positions: list[int], seq_lens: list[int], capture_logits: bool) -> ForwardBatch:
        sp = list(map(_get_sp, self.reqs))
        return ForwardBatch(
            input_ids=int64_tensor(ids),  # = torch.tensor(..., dtype=torch.int64), faster
            positions=int64_tensor(positions),
            out_cache_loc=int64_tensor(self.out_slots),
            req_pool_indices=int64_tensor(map(_get_pool_idx, self.reqs)),
            seq_lens=int64_tensor(seq_lens),
            extend_prefix_lens=list(self.prefix_lens),
            extend_seq_lens=list(self.extend_lens),
            sampling=SamplingBatchInfo(
                temperatures=list(map(_get_temperature, sp)),
                top_ps=list(map(_get_top_p, sp)),
                top_ks=list(map(_get_top_k, sp)),
                min_ps=list(map(_get_min_p, sp)),
                seeds=list(map(_get_seed, sp)),
                steps=[len(r.output_ids) for r in self.reqs],
                return_logprob=list(map(_get_logprobs, sp)),
                top_logprobs_nums=list(map(_get_top_logprobs_num, sp)),
            ),
            capture_logits=capture_logits,
        )


_get_sp = attrgetter("sampling_params")
_get_pool_idx = attrgetter("req_pool_idx")
_get_temperature = attrgetter("temperature")
_get_top_p = attrgetter("top_p")
_get_top_k = attrgetter("top_k")
_get_min_p = attrgetter("min_p")
_get_seed = attrgetter("seed")
_get_logprobs = attrgetter("logprobs")
_get_top_logprobs_num = attrgetter("top_logprobs_num")
