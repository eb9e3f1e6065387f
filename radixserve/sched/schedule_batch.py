"""``ScheduleBatch``: the requests of one step, their mode, and how it becomes a ``ForwardBatch``."""

from __future__ import annotations

from enum import Enum, auto
from itertools import accumulate, compress
from operator import attrgetter, itemgetter, not_

import torch

from radixserve.mem.draft_tree import chain, depths
from radixserve.mem.forward_batch import (
    ForwardBatch,
    PromptLogprobRows,
    SamplingBatchInfo,
    VerifyRows,
    int64_tensor,
)
from radixserve.mem.penalties import RowPenalties
from radixserve.sched.req import Req

DRAFT_BY_RUNNER = -1  # a draft token the runner's draft model is to make (speculative decoding)


class ForwardMode(Enum):
    EXTEND = auto()  # prefill / chunk of a prompt (possibly after a cached prefix)
    DECODE = auto()  # one new token per request
    MIXED = auto()  # extends and decodes in one forward (the unified scheduler's steps)

    def is_extend(self) -> bool:
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED)


class ScheduleBatch:
    def __init__(self, reqs: list[Req] | None = None, forward_mode: ForwardMode = ForwardMode.DECODE) -> None:
        self.reqs: list[Req] = list(reqs or [])
        self.forward_mode = forward_mode
        # filled by the scheduler when it allocates this step's KV
        self.extend_lens: list[int] = []
        self.prefix_lens: list[int] = []
        self.out_slots: list[int] = []
        self.num_decode = 0  # rows of a MIXED step that decode one token (the rest extend)
        # per row, the draft tokens it verifies after its last token this step (speculative
        # decoding, sched/spec.py); None: no row drafts
        self.drafts: list[list[int]] | None = None
        # per row, its drafts' parents where they branch (mem/draft_tree.py; None: a chain);
        # None: every row's drafts are a chain
        self.draft_parents: list[list[int] | None] | None = None
        # what the requests' rows repeat every step (pool rows, sampling params, output fields):
        # a running batch keeps its requests for many steps, so these are kept with it
        self.columns = RowColumns()

    def __len__(self) -> int:
        return len(self.reqs)

    def is_empty(self) -> bool:
        return not self.reqs

    def snapshot(self) -> ScheduleBatch:
        """A copy of the step's lists: what the overlap loop processes once the forward is done,
        while the running batch it came from is already being rebuilt for the next step."""
        b = ScheduleBatch(self.reqs, self.forward_mode)
        b.extend_lens, b.prefix_lens = list(self.extend_lens), list(self.prefix_lens)
        b.columns = self.columns.copy()  # keyed by the same requests
        b.num_decode = self.num_decode
        b.drafts = self.drafts
        b.draft_parents = self.draft_parents
        return b

    def to_forward_batch(self, capture_logits: bool = False, pending: dict[int, int] | None = None) -> ForwardBatch:
        """``pending`` (the overlap loop): ``id(req) -> i`` for requests whose last token is the
        ``i``-th output of the forward still running; their input id is the placeholder ``-(i + 1)``,
        which the forward thread replaces with that token (``overlap.ForwardThread``)."""
        if self.forward_mode is ForwardMode.DECODE and self.drafts is None:
            return self._decode_forward_batch(capture_logits, pending)
        drafts, trees = self.drafts, self.draft_parents
        ids: list[int] = []
        positions: list[int] = []
        steps = [len(r.output_ids) for r in self.reqs]
        for i, (req, start, n) in enumerate(zip(self.reqs, self.prefix_lens, self.extend_lens, strict=True)):
            k = req.prompt_len
            j = pending.get(id(req)) if pending else None
            if j is not None:  # a decode row of a MIXED step whose input is still being sampled
                assert n == 1 and start >= k, "only a decode waits for a token"
                ids.append(-(j + 1))
                steps[i] += 1
            elif drafts is not None and drafts[i]:  # decode of the last token, then the drafts
                assert n == 1 + len(drafts[i]) and start == req.num_tokens - 1
                ids.append(req.output_ids[-1])
                ids.extend(drafts[i] if drafts[i][0] != DRAFT_BY_RUNNER else [0] * len(drafts[i]))
            elif start >= k:  # decode, or recompute within the outputs
                ids.extend(req.output_ids[start - k : start - k + n])
            elif start + n <= k:
                ids.extend(req.origin_input_ids[start : start + n])
            else:
                ids.extend(req.origin_input_ids[start:])
                ids.extend(req.output_ids[: start + n - k])
            tree = trees[i] if trees is not None else None
            if tree is None:
                positions.extend(range(start, start + n))
            else:  # a draft's position is its depth below the last token
                positions.append(start)
                positions.extend(start + h for h in depths(tree))
        seq_lens = [s + n for s, n in zip(self.prefix_lens, self.extend_lens, strict=True)]
        fb = self._make(ids, int64_tensor(positions), int64_tensor(seq_lens), capture_logits, steps)
        fb.prompt_logprobs = self._prompt_logprob_rows()
        if drafts is not None:
            fb.verify = self._verify_rows(drafts)
        return fb

    def _verify_rows(self, drafts: list[list[int]]) -> VerifyRows:
        """The rows with drafts and the flat positions before each one's last (the last token and
        every draft but the final one: the final one's logits are the row's last)."""
        rows: list[int] = []
        kept: list[list[int]] = []
        positions: list[int] = []
        flat = 0
        for i, (d, n) in enumerate(zip(drafts, self.extend_lens, strict=True)):
            if d:
                rows.append(i)
                kept.append(d)
                positions.extend(range(flat, flat + len(d)))
            flat += n
        trees = self.draft_parents
        parents = [trees[i] or chain(len(drafts[i])) for i in rows] if trees is not None else None
        return VerifyRows(rows, kept, positions, by_runner=any(d[0] == DRAFT_BY_RUNNER for d in kept),
                          parents=parents)

    def _prompt_logprob_rows(self) -> PromptLogprobRows | None:
        """The prompt positions of this extend whose next token's logprob a request still waits for:
        position ``p`` gives token ``p + 1``'s, up to the prompt's last token (the one after it is the
        first output, whose logprob is an output logprob)."""
        starts = list(map(_get_input_logprob_start, self.reqs))
        if starts.count(None) == len(starts):
            return None
        rows: PromptLogprobRows | None = None
        flat = 0
        for i, (req, start, n) in enumerate(zip(self.reqs, self.prefix_lens, self.extend_lens, strict=True)):
            first = req.input_logprob_start
            if first is not None and not req.output_ids:
                lo, hi = max(start, max(first, 1) - 1), min(start + n, req.prompt_len - 1)
                if lo < hi:
                    rows = rows or PromptLogprobRows([])
                    prompt, top = req.origin_input_ids, req.sampling_params.top_logprobs_num
                    for p in range(lo, hi):
                        rows.positions.append(flat + p - start)
                        rows.rows.append(i)
                        rows.targets.append(prompt[p + 1])
                        rows.token_index.append(p + 1)
                        rows.top_n.append(top)
            flat += n
        return rows

    def _decode_forward_batch(self, capture_logits: bool, pending: dict[int, int] | None = None) -> ForwardBatch:
        """One token per request at position ``prefix_len``: the same batch as the general path.
        A decoding request's position is ``prompt + outputs - 1``: its input is its last output
        (or, pending, the placeholder of the token the running forward is producing)."""
        outs = list(map(_get_output_ids, self.reqs))
        positions = int64_tensor(self.prefix_lens)
        steps = list(map(len, outs))
        if not pending:
            return self._make(list(map(_last, outs)), positions, positions + 1, capture_logits, steps)
        ids = []
        for k, (req, out) in enumerate(zip(self.reqs, outs, strict=True)):
            j = pending.get(id(req))
            if j is None:
                ids.append(out[-1])
            else:
                ids.append(-(j + 1))
                steps[k] += 1  # the pending token counts as generated (seeded sampling's step)
        return self._make(ids, positions, positions + 1, capture_logits, steps)

    def extend(self, reqs: list[Req]) -> None:
        """Append requests (prefilled ones joining the running batch), the columns kept in step."""
        self.columns.extend(self.reqs, reqs)
        self.reqs.extend(reqs)

    def drop_finished(self) -> None:
        """Drop the requests that ended, the columns kept in step."""
        keep = list(map(not_, map(_get_finished_reason, self.reqs)))
        self.columns.keep(self.reqs, keep)
        self.reqs = list(compress(self.reqs, keep))

    def out_columns(self) -> list[list]:
        """Rids, prompt lengths, cached tokens, queue times, retractions and stream flags: what an
        output row of a running request repeats every step."""
        return self.columns.get(self.reqs)[_OUT]

    def _make(self, ids: list[int], positions: torch.Tensor, seq_lens: torch.Tensor, capture_logits: bool,
              steps: list[int]) -> ForwardBatch:
        cols = self.columns.get(self.reqs)
        pool_rows, temperatures, top_ps, top_ks, min_ps, seeds, logprobs, top_logprobs_nums = cols[_SAMPLING]
        penalized = list(compress(range(len(self.reqs)), cols[_PENALIZED])) if any(cols[_PENALIZED]) else []
        grammars = cols[_GRAMMAR]
        constrained = grammars.count(None) != len(grammars)
        input_ids = int64_tensor(ids)  # = torch.tensor(..., dtype=torch.int64), faster
        return ForwardBatch(
            input_ids=input_ids,
            positions=positions,
            out_cache_loc=int64_tensor(self.out_slots),
            req_pool_indices=int64_tensor(pool_rows),
            seq_lens=seq_lens,
            extend_prefix_lens=list(self.prefix_lens),
            extend_seq_lens=list(self.extend_lens),
            sampling=SamplingBatchInfo(
                temperatures=temperatures,
                top_ps=top_ps,
                top_ks=top_ks,
                min_ps=min_ps,
                seeds=seeds,
                steps=steps,
                return_logprob=logprobs,
                top_logprobs_nums=top_logprobs_nums,
                penalties=self._penalties(penalized, ids) if penalized else None,
                input_ids=input_ids if penalized else None,
                grammars=self._grammars(grammars) if constrained else None,
            ),
            capture_logits=capture_logits,
            rids=list(cols[_RIDS]),
        )


    def _grammars(self, matchers: list) -> list:
        """The matchers of the rows that sample a token this step: every row of a decode step; in an
        extend, not the rows of a prompt chunk that does not reach the end of its tokens."""
        if self.forward_mode is ForwardMode.DECODE:
            return list(matchers)
        return [m if m is not None and start + n >= req.num_tokens else None
                for m, req, start, n in zip(matchers, self.reqs, self.prefix_lens, self.extend_lens, strict=True)]

    def _penalties(self, penalized: list[int], ids: list[int]) -> list[RowPenalties | None]:
        """Each row's penalty inputs (None for the rows without any). A row's history is its output
        ids now, plus its last input id when that is a placeholder (the overlap loop's token that
        the running forward is still sampling: the sampler reads it once resolved)."""
        rows: list[RowPenalties | None] = [None] * len(self.reqs)
        flat = self.forward_mode is not ForwardMode.DECODE or self.drafts is not None
        ends = list(accumulate(self.extend_lens)) if flat else None
        for i in penalized:
            req = self.reqs[i]
            last = ends[i] - 1 if ends is not None else i
            rows[i] = req.sampling_params.penalty_row(req.output_ids, last if ids[last] < 0 else -1,
                                                      req.eos_token_ids)
        return rows


_get_sp = attrgetter("sampling_params")
_get_penalized = attrgetter("penalized")
_get_output_ids = attrgetter("output_ids")
_last = itemgetter(-1)
_get_pool_idx = attrgetter("req_pool_idx")
_get_rid = attrgetter("rid")
_get_input_ids = attrgetter("origin_input_ids")
_get_cached = attrgetter("cached_tokens")
_get_queue_time = attrgetter("queue_time")
_get_retractions = attrgetter("num_retractions")
_get_stream = attrgetter("stream")
_SAMPLING_FIELDS = tuple(map(attrgetter, ("temperature", "top_p", "top_k", "min_p", "seed", "logprobs",
                                           "top_logprobs_num")))
_get_finished_reason = attrgetter("finished_reason")
_get_grammar = attrgetter("grammar")
_get_input_logprob_start = attrgetter("input_logprob_start")


def build_columns(reqs: list[Req]) -> list[list]:
    """One list per column of ``RowColumns``, for ``reqs``: C passes over the requests."""
    sp = list(map(_get_sp, reqs))
    return [list(map(_get_pool_idx, reqs)), *(list(map(get, sp)) for get in _SAMPLING_FIELDS),
            list(map(_get_penalized, reqs)), list(map(_get_rid, reqs)), list(map(len, map(_get_input_ids, reqs))),
            list(map(_get_cached, reqs)), list(map(_get_queue_time, reqs)), list(map(_get_retractions, reqs)),
            list(map(_get_stream, reqs)), list(map(_get_grammar, reqs))]


# the columns: pool row and sampling params (the forward batch's), penalized flag, then what an
# output row repeats (rid, prompt length, cached tokens, queue time, retractions, stream flag), then
# the grammar matcher (None for most)
_SAMPLING = slice(0, 8)
_PENALIZED = 8
_RIDS = 9
_OUT = slice(9, 15)
_GRAMMAR = 15


class RowColumns:
    """Per-request values that do not change while a request stays in a batch, one list per
    column, in the batch's order: the running batch's requests change by a few per step (some
    finish, a few join), so the columns follow those changes (``keep``, ``extend``) instead of
    being rebuilt with a pass per column over every request. Any other change to the request list
    (a retraction, a preemption) is noticed by comparing it with the list the columns were built
    for (by identity, a few microseconds), and the columns are rebuilt."""

    __slots__ = ("key", "cols")

    def __init__(self) -> None:
        self.key: list[Req] | None = None  # the requests the columns are for, in order
        self.cols: list[list] = []

    def get(self, reqs: list[Req]) -> list[list]:
        if self.key is None or self.key != reqs:
            self.key, self.cols = list(reqs), build_columns(reqs)
        return self.cols

    def extend(self, reqs: list[Req], new: list[Req]) -> None:
        """``reqs`` (the batch's list, before) gets ``new`` appended."""
        if self.key is not None and self.key == reqs:
            # new lists, not extended in place: a snapshot of the batch may share the old ones
            self.cols = [col + add for col, add in zip(self.cols, build_columns(new), strict=True)]
            self.key = self.key + new

    def keep(self, reqs: list[Req], keep: list[bool]) -> None:
        """``reqs`` (the batch's list, before) keeps the rows where ``keep`` is true."""
        if self.key is not None and self.key == reqs:
            if all(keep):
                return
            self.cols = [list(compress(col, keep)) for col in self.cols]
            self.key = list(compress(self.key, keep))

    def copy(self) -> RowColumns:
        c = RowColumns()
        c.key, c.cols = self.key, self.cols  # shared: neither is ever changed in place
        return c
