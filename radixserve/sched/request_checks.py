"""Whether a request can run on this engine at all, checked once where it enters (the HTTP front
end, ``Engine.generate``, the simulator), before the scheduler gets it. The scheduler trusts what
these let through and keeps only the checks of its live state: a duplicate id, priorities under the
live settings, deadline admission, the queue cap (``intake.py``).

- the prompt: not empty, every token id in the vocabulary, shorter than the context;
- the output budget: an asked ``max_new_tokens`` is clipped to what the context leaves (SGLang's
  rule; OpenAI's endpoints refuse instead, ``clip=False``), none means as many as fit; either way it
  must stay below what the KV pool holds with the prompt (``new_token_room``), or the request would
  wait forever;
- the prompt logprobs asked for (``logprob_start_len``): -1 / none, or a position in the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from radixserve.sched.finish import FINISH_ABORT
from radixserve.sched.sampling_params import new_token_room

if TYPE_CHECKING:  # (the HTTP process imports this module and must not load torch, which Req brings)
    from radixserve.sched.req import Req


@dataclass(frozen=True)
class Limits:
    vocab_size: int | None
    context_len: int
    pool_tokens: int  # KV slots of the pool the request will run in


def prompt_error(ids: Sequence[int], limits: Limits, param: str = "prompt",
                 ids_param: str | None = None) -> FINISH_ABORT | None:
    """``ids_param``: the field a bad token id is blamed on (default ``param``)."""
    if not ids:
        return FINISH_ABORT("the prompt is empty", param=param)
    vocab = limits.vocab_size
    if vocab is not None and any((not isinstance(t, int)) or not 0 <= t < vocab for t in ids):
        return FINISH_ABORT(f"token ids must be integers in [0, {vocab})", param=ids_param or param)
    if len(ids) >= limits.context_len:
        return FINISH_ABORT(f"This model's maximum context length is {limits.context_len} tokens; the prompt has "
                            f"{len(ids)}.", code="context_length_exceeded", param=param)
    return None


def logprob_start(start: int | None, prompt_len: int, param: str = "logprob_start_len") -> int | None | FINISH_ABORT:
    """The prompt token from which prompt logprobs are wanted (None: none; -1 is SGLang's "the output
    only"), or the refusal."""
    if start is None or start == -1:
        return None
    if not 0 <= start < prompt_len:
        return FINISH_ABORT(f"{param} must be -1 or a prompt position in [0, {prompt_len}), got {start}",
                            param=param, code="invalid_value")
    return start


def max_new_tokens(prompt_len: int, asked: int | None, limits: Limits, *, clip: bool = True,
                   prompt_param: str = "prompt", param: str = "max_new_tokens") -> int | FINISH_ABORT:
    """The output budget to run with, or the refusal (``param`` names the asked field)."""
    ctx, pool = limits.context_len, limits.pool_tokens
    room = new_token_room(prompt_len, ctx, pool)
    if asked is None:
        if room < 1:
            return FINISH_ABORT(
                f"the prompt has {prompt_len} tokens, which leaves no room for a completion in this model's "
                f"context ({ctx} tokens) and KV pool ({pool} tokens). Please reduce the prompt.",
                code="context_length_exceeded", param=prompt_param)
        return room
    if prompt_len + asked > ctx:
        if not clip:
            return FINISH_ABORT(
                f"This model's maximum context length is {ctx} tokens. However, you requested "
                f"{prompt_len + asked} tokens ({prompt_len} in the prompt, {asked} for the completion). "
                "Please reduce the prompt or max_tokens.", code="context_length_exceeded", param=param)
        asked = ctx - prompt_len
    if asked > room:
        return FINISH_ABORT(
            f"prompt {prompt_len} + max_new_tokens {asked} = {prompt_len + asked} tokens must be below the KV "
            f"pool size {pool}", code="context_length_exceeded", param=param)
    return asked


def check_request(req: Req, limits: Limits) -> FINISH_ABORT | None:
    """``prompt_error``, then ``max_new_tokens`` (clipped) written into the request's parameters."""
    err = prompt_error(req.origin_input_ids, limits, ids_param="input_ids")
    if err is not None:
        return err
    sp = req.sampling_params
    n = max_new_tokens(req.prompt_len, sp.max_new_tokens, limits, param="max_tokens")
    if isinstance(n, FINISH_ABORT):
        return n
    sp.max_new_tokens = n
    return None
