"""A decode step's results without logprobs: ``Scheduler.process_batch_result`` with the same
checks in the same order, less per-request work (it runs for every running request every step);
and ``check_finished``, the stop checks both use."""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixserve.mem.forward_batch import ForwardOutput
from radixserve.sched.finish import FINISH_LENGTH, FINISH_STOP, BaseFinishReason
from radixserve.sched.req import Req
from radixserve.sched.schedule_batch import ScheduleBatch

if TYPE_CHECKING:
    from radixserve.sched.scheduler import Scheduler


def process_decode_result(sched: Scheduler, batch: ScheduleBatch, out: ForwardOutput, now: float) -> None:
    """``process_batch_result`` of a decode step without logprobs, with less per-request work
    (the same checks in the same order)."""
    context_len, detok = sched.context_len, sched.detokenize
    emit = sched._emit
    generated = 0
    if len(out.next_token_ids) < len(batch.reqs):
        raise IndexError("the runner returned fewer tokens than the batch has requests")
    for req, tok in zip(batch.reqs, out.next_token_ids, strict=False):
        output_ids = req.output_ids
        n_out = len(output_ids)
        if len(req.kv_indices) < len(req.origin_input_ids) + n_out:  # a prompt chunk: no token yet
            sched.tree_cache.cache_unfinished_req(req)
            continue
        if req.finished_reason is not None:
            continue
        output_ids.append(tok)
        n_out += 1
        if req.first_token_time is None:
            req.first_token_time = now
        generated += 1
        sp = req.sampling_params
        reason: BaseFinishReason | None = None
        if not sp.ignore_eos and tok in req.eos_token_ids:
            reason = FINISH_STOP(tok)
        elif tok in sp.stop_token_ids:
            reason = FINISH_STOP(tok)
        elif n_out >= sp.max_new_tokens:
            reason = FINISH_LENGTH(sp.max_new_tokens)
        elif len(req.origin_input_ids) + n_out >= context_len:
            reason = FINISH_LENGTH(n_out)
        elif sp.stop and detok is not None:
            reason = check_finished(sched, req)
        if reason is not None:
            sched.stats.generated_tokens += generated
            generated = 0
            sched.kv.release(req)
            sched._finish(req, reason)
        else:
            emit(req)
    sched.stats.generated_tokens += generated


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
