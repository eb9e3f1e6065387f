"""``ReqState``: what the HTTP process knows of one request while it runs (its outputs so far, its
timing, its class), read by the endpoints, the metrics and the dashboard."""

from __future__ import annotations

from dataclasses import dataclass, field

from radixserve.sched.io import InputLogprobsOut, OutRow


@dataclass
class ReqState:
    rid: str
    index: int  # choice index within its group
    created: float
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    input_logprobs: InputLogprobsOut | None = None  # the prompt's, when asked for (they come first)
    last: OutRow | None = None
    first_token_time: float | None = None
    finished: bool = False
    priority: int | None = None  # per-class metrics
    tenant: str | None = None
    spec: tuple[int, int] | None = None  # speculative decoding's counts, as last reported

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.created
