"""What the scheduler emits: a ``ReqOutput`` per request for each step that produced a token of a
streaming request, for the first token, and at the finish (``Req.stream``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from radixserve.sched.finish import BaseFinishReason


@dataclass(slots=True)  # one per request per step: slots make it smaller and quicker to build
class ReqOutput:
    rid: str
    new_token_ids: list[int]
    finished_reason: BaseFinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    new_logprobs: list[float] = field(default_factory=list)
    new_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    queue_time: float = 0.0  # arrival -> first scheduled
    num_retractions: int = 0
