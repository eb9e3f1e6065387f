"""A decode step's results without logprobs: ``Scheduler.process_batch_result`` with the same
checks, less per-request work (it runs for every running request every step); and
``check_finished``, the stop checks both use."""

from __future__ import annotations

from collections import deque
from itertools import compress
from operator import attrgetter, ge, or_
from typing import TYPE_CHECKING

from radixserve.mem.forward_batch import ForwardOutput
from radixserve.sched.finish import FINISH_LENGTH, FINISH_STOP, BaseFinishReason
from radixserve.sched.req import Req
from radixserve.sched.schedule_batch import ScheduleBatch

if TYPE_CHECKING:
    from radixserve.sched.scheduler import Scheduler


def process_decode_result(sched: Scheduler, batch: ScheduleBatch, out: ForwardOutput) -> bool:
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
    sched.stats.generated_tokens += len(reqs)
    maybe = map(or_, map(ge, map(len, outs), map(_get_max_new, reqs)),
                map(frozenset.__contains__, map(_get_finish_ids, reqs), toks))
    if sched.detokenize is not None:
        maybe = map(or_, maybe, map(bool, map(_get_stop, reqs)))
    for req in list(compress(reqs, maybe)):
        reason = check_finished(sched, req)
        if reason is not None:
            sched.kv.release(req)
            sched._finish(req, reason)
    emit = sched._emit
    for req in filter(_get_stream, reqs):
        if req.finished_reason is None:
            emit(req)
    return True


_get_finished_reason = attrgetter("finished_reason")
_get_output_ids = attrgetter("output_ids")
_get_max_new = attrgetter("sampling_params.max_new_tokens")
_get_finish_ids = attrgetter("finish_token_ids")
_get_stop = attrgetter("sampling_params.stop")
_get_stream = attrgetter("stream")


def check_finished(sched: Scheduler, req: Req) -> BaseFinishReason | None:
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
    if req.num_tokens >= sched.context_len:
        return FINISH_LENGTH(len(req.output_ids))
    if sp.stop and sched.detokenize is not None:
        window = max(len(s) for s in sp.stop) + 2
        tail = sched.detokenize(req.output_ids[-window:])
        for s in sp.stop:
            if s in tail:
                return FINISH_STOP(s)
    return None
