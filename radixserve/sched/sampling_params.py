"""Per-request sampling parameters and their validation (bad values become 400s, not crashes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class InvalidRequest(ValueError):
    """A request the engine refuses; carries the OpenAI-style ``param`` that was wrong."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    skip_special_tokens: bool = True
    logprobs: bool = False
    top_logprobs_num: int = 0

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        d = dict(d or {})
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise InvalidRequest(f"unknown sampling parameter(s): {', '.join(unknown)}", param=unknown[0])
        if isinstance(d.get("stop"), str):
            d["stop"] = [d["stop"]]
        if d.get("stop") is None:
            d.pop("stop", None)
        if d.get("stop_token_ids") is None:
            d.pop("stop_token_ids", None)
        p = cls(**d)
        p.verify()
        return p

    def verify(self, vocab_size: int | None = None) -> None:
        def bad(msg: str, param: str) -> InvalidRequest:
            return InvalidRequest(msg, param=param)

        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise bad(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}", "max_new_tokens")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise bad(f"temperature must be >= 0, got {self.temperature!r}", "temperature")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            raise bad(f"top_k must be -1 (off) or >= 1, got {self.top_k!r}", "top_k")
        if not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            raise bad(f"min_p must be in [0, 1], got {self.min_p!r}", "min_p")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise bad("stop must be a string or a list of strings", "stop")
        if any(s == "" for s in self.stop):
            raise bad("stop strings must not be empty", "stop")
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise bad("stop_token_ids must be a list of non-negative integers", "stop_token_ids")
        if vocab_size is not None and any(t >= vocab_size for t in self.stop_token_ids):
            raise bad(f"stop_token_ids must be < vocab size {vocab_size}", "stop_token_ids")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise bad("seed must be an integer", "seed")
        if not isinstance(self.top_logprobs_num, int) or not 0 <= self.top_logprobs_num <= 20:
            raise bad("top_logprobs must be between 0 and 20", "top_logprobs")

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 1e-6 or self.top_k == 1
