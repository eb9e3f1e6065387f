"""``Outputs``: a step's results become tokens on requests and rows of the step's ``BatchOut``.

It owns the end of a request's life: the stop checks (``check_finished``), finishing
(``finish``: the finish reason, the counters, unregistering), and the rows it emits: one per
request per step that produced a token of a streaming request, the first token, and the finish
(``Req.stream``). ``process_decode_result`` is the fast path for decode steps without logprobs
(it runs for every running request every step).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from itertools import compress, repeat
from operator import and_, attrgetter, ge, getitem, not_, or_
from typing import Any

from radixserve.mem.forward_batch import ForwardOutput, PromptLogprobs
from radixserve.sched.finish import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, FinishReason
from radixserve.sched.io import NO_LOGPROBS, NO_TOP_LOGPROBS, BatchOut, DetokParams, InputLogprobsOut
from radixserve.sched.kv_manager import KVManager
from radixserve.sched.req import Req
from radixserve.sched.schedule_batch import ForwardMode, ScheduleBatch
from radixserve.sched.stats import SchedStats


class Outputs:
    def __init__(
        self, kv: KVManager, stats: SchedStats, by_rid: dict[str, Req], clock: Callable[[], float], context_len: int,
        detokenize: Callable[[list[int]], str] | None = None, hold: Callable[[Req], bool] | None = None,
    ) -> None:
        """``hold``: keeps an ended request's KV while a running forward still includes it, or says
        False (``ForwardThread.hold``, the overlap loop)."""
        self.kv = kv
        self.stats = stats
        self.by_rid = by_rid
        self.clock = clock
        self.context_len = context_len
        self.detokenize = detokenize
        self.records = BatchOut()
        self.hold = hold

    def take(self) -> BatchOut:
        """The rows emitted since the last call."""
        out, self.records = self.records, BatchOut()
        return out

    # --- a step's results ----------------------------------------------------------------------
    def process_batch_result(self, batch: ScheduleBatch, out: ForwardOutput,
                             kept: dict[int, list[int]] | None = None) -> None:
        """``kept``: speculative decoding's rows (``Speculation.accept``): row -> the tokens it keeps."""
        now = self.clock()
        is_extend = batch.forward_mode.is_extend()
        if (not is_extend and kept is None and out.logprobs is None and out.top_logprobs is None
                and out.grammar_ended is None and self.process_decode_result(batch, out)):
            return
        grammar_ended = out.grammar_ended or {}
        verify_index = {row: j for j, row in enumerate(sorted(kept))} if kept else {}
        if out.prompt_logprobs is not None:
            store_prompt_logprobs(batch.reqs, out.prompt_logprobs)
        for i, req in enumerate(batch.reqs):
            if req.num_computed_tokens < req.num_tokens:  # a prompt chunk: no token yet
                self.kv.cache_unfinished(req)
                continue
            if req.finished():
                continue
            if kept is not None and i in kept:
                j = verify_index[i]
                reason = self._append_kept(
                    req, kept[i], out.verified_logprobs[j] if out.verified_logprobs is not None else None,
                    out.verified_top_logprobs[j] if out.verified_top_logprobs is not None else None)
                if reason is None and i in grammar_ended:
                    reason = grammar_finish(grammar_ended[i])
                if reason is not None:
                    self.end(req, reason)
                elif req.stream:
                    self.emit(req)
                continue
            req.output_ids.append(out.next_token_ids[i])
            if out.logprobs is not None:
                req.output_logprobs.append(out.logprobs[i])
            if out.top_logprobs is not None:
                req.output_top_logprobs.append(out.top_logprobs[i])
            if req.first_token_time is None:
                req.first_token_time = now
            self.stats.generated_tokens += 1
            reason = self.check_finished(req)
            if reason is None and i in grammar_ended:
                reason = grammar_finish(grammar_ended[i])
            if reason is not None:
                self.end(req, reason)
            else:
                # (in a MIXED step only the requests whose prompt ended in it: not every decode)
                if is_extend and (batch.forward_mode is ForwardMode.EXTEND or batch.prefix_lens[i] < req.prompt_len):
                    self.kv.cache_unfinished(req)  # make the prompt shareable now
                if req.stream or len(req.output_ids) == 1:  # one that does not stream: first token only
                    self.emit(req)

    def _append_kept(self, req: Req, tokens: list[int], logprobs: list[float] | None = None,
                     top_logprobs: list[list[tuple[int, float]]] | None = None) -> FinishReason | None:
        """A verify row's kept tokens (and their logprobs, position by position), one at a time with
        the stop checks (a stop ends the request at that token, the rest are dropped); then its KV
        is cut back to the tokens it holds (the last token's KV is the next step's to write),
        freeing what the rejected drafts took."""
        reason = None
        for j, t in enumerate(tokens):
            req.output_ids.append(t)
            if logprobs is not None:
                req.output_logprobs.append(logprobs[j])
            if top_logprobs is not None:
                req.output_top_logprobs.append(top_logprobs[j])
            self.stats.generated_tokens += 1
            reason = self.check_finished(req)
            if reason is not None:
                break
        self.kv.truncate(req, req.num_tokens - 1)
        return reason

    def process_decode_result(self, batch: ScheduleBatch, out: ForwardOutput) -> bool:
        """``process_batch_result`` of a decode step without logprobs. It runs for every running request
        every step, so the common work is done in C passes (``map`` over the batch) and Python code runs
        only for the requests that may stop and the ones that stream:

        - a decode batch holds no prompt chunk and no request without a first token, so the general
          path's chunk check and ``first_token_time`` are left out;
        - a request may stop when its token is in ``finish_token_ids`` (EOS unless ``ignore_eos``, and
          ``stop_token_ids``), it reached ``max_new_tokens``, or it has stop strings; only those run
          ``check_finished``, in batch order, for the reason. The context needs no test of its own:
          ``add_request`` clipped ``max_new_tokens`` to the room it leaves;
        - a request that does not stream (``Req.stream`` False) sends nothing until it finishes.

        Returns False, having done nothing, when the batch holds a request that already ended (none
        does in practice): the general path skips those.
        """
        reqs, toks = batch.reqs, out.next_token_ids
        if len(toks) < len(reqs):
            raise IndexError("the runner returned fewer tokens than the batch has requests")
        if any(map(_get_finished_reason, reqs)):
            return False
        outs = list(map(_get_output_ids, reqs))
        deque(map(list.append, outs, toks), maxlen=0)  # each request's new token, in C
        self.stats.generated_tokens += len(reqs)
        maybe = map(or_, map(ge, map(len, outs), map(_get_max_new, reqs)),
                    map(frozenset.__contains__, map(_get_finish_ids, reqs), toks))
        if self.detokenize is not None:
            maybe = map(or_, maybe, map(bool, map(_get_stop, reqs)))
        ended: list[int] = []  # rows that finished in this step (their last row is the finish's)
        for i in list(compress(range(len(reqs)), maybe)):
            reason = self.check_finished(reqs[i])
            if reason is not None:
                self.end(reqs[i], reason)
                ended.append(i)
        if any(map(_get_stream, reqs)):
            self.emit_decoded(batch, outs, ended)
        return True

    def check_finished(self, req: Req) -> FinishReason | None:
        """Whether ``req`` stops after its last output token: EOS (unless ``ignore_eos``), a stop token
        id, ``max_new_tokens``, the context full, or a stop string in the detokenized tail."""
        sp = req.sampling_params
        tok = req.output_ids[-1]
        if not sp.ignore_eos and tok in req.eos_token_ids:
            return FINISH_STOP(tok)
        if tok in sp.stop_token_ids:
            return FINISH_STOP(tok)
        if len(req.output_ids) >= sp.max_new_tokens:
            return FINISH_LENGTH(sp.max_new_tokens)
        if req.num_tokens >= self.context_len:
            return FINISH_LENGTH(len(req.output_ids))
        # (the sampler masks EOS and stop token ids until min_new_tokens; a stop string waits too)
        if sp.stop and self.detokenize is not None and len(req.output_ids) >= sp.min_new_tokens:
            window = max(len(s) for s in sp.stop) + 2
            tail = self.detokenize(req.output_ids[-window:])
            for s in sp.stop:
                if s in tail:
                    return FINISH_STOP(s)
        return None

    # --- the end of a request ------------------------------------------------------------------
    def end(self, req: Req, reason: FinishReason) -> None:
        """``req`` leaves: its KV goes to the cache (or is freed; later, while a running forward
        still includes it), then ``finish``."""
        if self.hold is None or not self.hold(req):
            self.kv.release(req)
        self.finish(req, reason)

    def finish(self, req: Req, reason: FinishReason) -> None:
        """Record the finish reason, count it, unregister the request and emit its last record.
        The caller has dealt with its KV (``end`` does both)."""
        req.finished_reason = reason
        req.finished_time = self.clock()
        if self.by_rid.get(req.rid) is req:  # a rejected duplicate must not unregister the original
            del self.by_rid[req.rid]
        if isinstance(reason, FINISH_ABORT):
            self.stats.num_aborted += 1
        else:
            self.stats.num_finished += 1
        self.emit(req)

    def emit(self, req: Req) -> None:
        """A row for ``req``: its tokens since its last row (runs per request per step: the columns
        are appended to directly)."""
        out_ids = req.output_ids
        n = len(out_ids)
        start = req.sent_len
        req.sent_len = n
        b = self.records
        b.rids.append(req.rid)
        b.token_ids.append(out_ids[start:n])
        b.finished_reasons.append(req.finished_reason)
        b.prompt_tokens.append(len(req.origin_input_ids))
        b.completion_tokens.append(n)
        b.cached_tokens.append(req.cached_tokens)
        b.logprobs.append(req.output_logprobs[start:n] if req.output_logprobs else [])
        b.top_logprobs.append(req.output_top_logprobs[start:n] if req.output_top_logprobs else [])
        b.queue_times.append(req.queue_time)
        b.num_retractions.append(req.num_retractions)
        if req.spec_verify_ct:
            b.spec[req.rid] = (req.spec_verify_ct, req.spec_accepted_tokens)
        if start == 0:  # the request's first row: how the detokenizer must decode it
            sp = req.sampling_params
            b.detok_params.append(DetokParams(req.rid, sp.stop, sp.skip_special_tokens))
            if req.input_logprob_start is not None:
                first = req.input_logprob_start
                b.input_logprobs.append(InputLogprobsOut(req.rid, first, req.origin_input_ids[first:],
                                                         req.input_logprobs, req.input_top_logprobs))


    def emit_decoded(self, batch: ScheduleBatch, outs: list[list[int]], ended: list[int]) -> None:
        """``emit`` for every request of a decode step (without logprobs) that streams and did not
        finish (``ended``: the rows that finished in this step, in order), a column at a time: what a
        row repeats comes from the batch's cached columns, the rest from C passes. At 1,024
        streaming requests this is about 1.8x faster than a Python call per row (docs/benchmarks.md)."""
        reqs = batch.reqs
        cols: list[list[Any]] = [reqs, outs, *batch.out_columns()]
        streams = cols.pop()
        if all(streams):
            if ended:  # a few rows: delete them from copies rather than filter every column
                cols = [list(col) for col in cols]
                for i in reversed(ended):
                    for col in cols:
                        del col[i]
        else:
            keep = list(map(and_, streams, map(not_, map(_get_finished_reason, reqs))))
            cols = [list(compress(col, keep)) for col in cols]
        reqs, outs, rids, prompt_lens, cached, queue_times, retractions = cols
        ns = list(map(len, outs))
        starts = list(map(_get_sent_len, reqs))
        k = len(reqs)
        b = self.records
        b.rids += rids
        b.token_ids += map(getitem, outs, map(slice, starts, ns))  # type: ignore[arg-type]  # out_ids[start:n]
        b.finished_reasons += repeat(None, k)
        b.prompt_tokens += prompt_lens
        b.completion_tokens += ns
        b.cached_tokens += cached
        b.logprobs += repeat(NO_LOGPROBS, k)
        b.top_logprobs += repeat(NO_TOP_LOGPROBS, k)
        b.queue_times += queue_times
        b.num_retractions += retractions
        deque(map(setattr, reqs, repeat("sent_len"), ns), maxlen=0)  # req.sent_len = n, in C
        if 0 in starts:  # a request's first row (a decode worker's first step after the KV hand-over)
            for req, start in zip(reqs, starts, strict=True):
                if start == 0:
                    sp = req.sampling_params
                    b.detok_params.append(DetokParams(req.rid, sp.stop, sp.skip_special_tokens))


_get_sent_len = attrgetter("sent_len")
_get_finished_reason = attrgetter("finished_reason")
_get_output_ids = attrgetter("output_ids")
_get_max_new = attrgetter("sampling_params.max_new_tokens")
_get_finish_ids = attrgetter("finish_token_ids")
_get_stop = attrgetter("sampling_params.stop")
_get_stream = attrgetter("stream")


def grammar_finish(error: str) -> FinishReason:
    """How a request ends when its grammar does (``ForwardOutput.grammar_ended``): complete is a
    ``stop``; a matcher error (the sampler drew a token the grammar refused) aborts the request."""
    if not error:
        return FINISH_STOP()
    return FINISH_ABORT(f"internal error: the output broke its grammar: {error}", status_code=500,
                        err_type="server_error", code="internal_error")


def store_prompt_logprobs(reqs: list[Req], got: PromptLogprobs) -> None:
    """File a step's prompt logprobs with their requests (by token index: a prompt recomputed after
    a preemption writes the same entries again)."""
    rows = got.rows
    for row, j, lp, top in zip(rows.rows, rows.token_index, got.logprobs, got.top_logprobs, strict=True):
        req = reqs[row]
        start = req.input_logprob_start
        if start is not None and j >= start:
            req.input_logprobs[j - start] = lp
            req.input_top_logprobs[j - start] = top
