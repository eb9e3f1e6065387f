"""One request's sampling penalties for one step: plain data, so the processes that parse requests
can build and check it without importing torch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class RowPenalties:
    """One request's penalties for one step (``SamplingParams.penalty_row`` builds it, the sampler
    applies it). Its history: ``output_ids[:n_out]``, plus ``input_ids[pending_pos]`` of the forward
    when ``pending_pos >= 0`` (the overlap loop's token sampled by the forward before, not yet in
    ``output_ids`` when the batch was built)."""

    frequency: float = 0.0
    presence: float = 0.0
    repetition: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_new_tokens: int = 0
    finish_ids: tuple[int, ...] = ()  # masked while fewer than min_new_tokens are generated
    output_ids: Sequence[int] = ()
    n_out: int = 0
    pending_pos: int = -1
