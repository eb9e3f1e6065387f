"""Per-request sampling parameters: one shape from the HTTP edge to the sampler.

``SamplingParams.from_dict`` builds and validates them once, where a request enters (the HTTP
process, ``Engine``): a bad value becomes a 400 naming the field, never a crash further in. The
struct then travels as it is, msgpack over ZeroMQ (msgspec checks the wire types), onto the
scheduler's ``Req``, which trusts it; ``ScheduleBatch`` turns a batch of them into the sampler's
columns.

Penalties (docs/api.md): ``frequency_penalty`` / ``presence_penalty`` (OpenAI, in [-2, 2]),
``repetition_penalty`` (SGLang / HF, in (0, 2]), ``logit_bias`` (OpenAI: token id -> bias in
[-100, 100]) and ``min_new_tokens`` (EOS and stop token ids masked until that many are generated).
A request with any of them set (``has_penalties``) hands the sampler a ``RowPenalties`` each step
(``penalty_row``); every other request costs the sampler nothing.

Structured output (SGLang's names): at most one of ``json_schema`` (a JSON schema, as a string or
an object), ``regex`` and ``ebnf`` (GBNF or Lark); checked here (``radixserve.grammar.validate_grammar``),
compiled by the scheduler, applied by the sampler as a token mask.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from radixserve.grammar import GRAMMAR_KINDS, validate_grammar
from radixserve.mem.penalties import RowPenalties
from radixserve.sched.noop_fields import SAMPLING, refusal


def new_token_room(prompt_len: int, context_len: int, pool_tokens: int) -> int:
    """The most new tokens a request with this prompt can be given: what the context has room for,
    and fewer than the KV pool holds with the prompt (the PrefillAdder admits a request only while
    prompt + max_new_tokens is below the free KV, so a request asking for the whole pool would wait
    forever). Below 1: the prompt cannot be served at all. The HTTP edge picks this for a request
    without ``max_tokens``; the scheduler refuses a request asking for more."""
    return min(context_len - prompt_len, pool_tokens - 1 - prompt_len)


class InvalidRequest(ValueError):
    """A request the engine refuses; carries the OpenAI-style ``param`` that was wrong."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class SamplingParams(msgspec.Struct):
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = []  # (msgspec gives each instance its own empty list)
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    seed: int | None = None
    skip_special_tokens: bool = True
    logprobs: bool = False
    top_logprobs_num: int = 0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # from JSON: token-id string keys, made ints by verify()
    min_new_tokens: int = 0
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None, vocab_size: int | None = None) -> SamplingParams:
        """Build and validate (``InvalidRequest`` naming the field); ``vocab_size`` bounds token ids."""
        if d is not None and not isinstance(d, dict):
            raise InvalidRequest("sampling_params must be an object", param="sampling_params")
        d = dict(d or {})
        for name in [k for k in d if k in SAMPLING]:  # SGLang's, where they change nothing here
            why = refusal(SAMPLING, name, d.pop(name))
            if why is not None:
                raise InvalidRequest(why, param=name, code="unsupported")
        known = set(cls.__struct_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise InvalidRequest(f"unknown sampling parameter(s): {', '.join(unknown)}", param=unknown[0])
        if isinstance(d.get("stop"), str):
            d["stop"] = [d["stop"]]
        if d.get("stop") is None:
            d.pop("stop", None)
        if d.get("stop_token_ids") is None:
            d.pop("stop_token_ids", None)
        if isinstance(d.get("json_schema"), dict):  # SGLang takes a string; an object is what people send
            d["json_schema"] = json.dumps(d["json_schema"])
        p = cls(**d)
        p.verify(vocab_size)
        return p

    def verify(self, vocab_size: int | None = None) -> None:
        def bad(msg: str, param: str) -> InvalidRequest:
            return InvalidRequest(msg, param=param)

        if not _is_int(self.max_new_tokens) or self.max_new_tokens <= 0:
            raise bad(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}", "max_new_tokens")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise bad(f"temperature must be a finite number >= 0, got {self.temperature!r}", "temperature")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k != -1):
            raise bad(f"top_k must be -1 (off) or >= 1, got {self.top_k!r}", "top_k")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad(f"min_p must be in [0, 1], got {self.min_p!r}", "min_p")
        for name in ("ignore_eos", "skip_special_tokens", "logprobs"):
            if not isinstance(getattr(self, name), bool):
                raise bad(f"{name} must be a boolean, got {getattr(self, name)!r}", name)
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise bad("stop must be a string or a list of strings", "stop")
        if any(s == "" for s in self.stop):
            raise bad("stop strings must not be empty", "stop")
        if not isinstance(self.stop_token_ids, list) or not all(
            _is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise bad("stop_token_ids must be a list of non-negative integers", "stop_token_ids")
        if vocab_size is not None and any(t >= vocab_size for t in self.stop_token_ids):
            raise bad(f"stop_token_ids must be < vocab size {vocab_size}", "stop_token_ids")
        if self.seed is not None and not _is_int(self.seed):
            raise bad("seed must be a 64-bit integer", "seed")
        if not _is_int(self.top_logprobs_num) or not 0 <= self.top_logprobs_num <= 20:
            raise bad("top_logprobs must be between 0 and 20", "top_logprobs")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -2.0 <= v <= 2.0:
                raise bad(f"{name} must be a number in [-2, 2], got {v!r}", name)
        if not _is_number(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 2.0:
            raise bad(f"repetition_penalty must be a number in (0, 2], got {self.repetition_penalty!r}",
                      "repetition_penalty")
        if not _is_int(self.min_new_tokens) or not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise bad(f"min_new_tokens must be an integer in [0, max_new_tokens = {self.max_new_tokens}], "
                      f"got {self.min_new_tokens!r}", "min_new_tokens")
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias, vocab_size)
        self._verify_grammar()

    def _verify_grammar(self) -> None:
        named = [k for k in GRAMMAR_KINDS if getattr(self, k) is not None]
        if not named:
            return
        if len(named) > 1:
            raise InvalidRequest(f"at most one of json_schema, regex and ebnf, got {' and '.join(named)}",
                                 param=named[1])
        kind = named[0]
        text = getattr(self, kind)
        if not isinstance(text, str) or not text:
            raise InvalidRequest(f"{kind} must be a non-empty string", param=kind, code="invalid_value")
        if self.min_new_tokens > 0:
            raise InvalidRequest(f"min_new_tokens cannot be combined with {kind}: the grammar decides where "
                                 "the output may end", param="min_new_tokens")
        err = validate_grammar(kind, text)
        if err is not None:
            raise InvalidRequest(f"invalid {kind}: {err}", param=kind, code="invalid_value")

    @property
    def grammar(self) -> tuple[str, str] | None:
        """``(kind, text)`` of the request's grammar, or None."""
        for kind in GRAMMAR_KINDS:
            text = getattr(self, kind)
            if text is not None:
                return kind, text
        return None

    @property
    def has_penalties(self) -> bool:
        """Whether the sampler must do anything for this request beyond temperature and filters."""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_new_tokens > 0)

    def penalty_row(self, output_ids: Sequence[int], pending_pos: int, eos_token_ids: Iterable[int]) -> RowPenalties:
        """This step's penalty inputs for a request whose outputs so far are ``output_ids`` (read
        now: the list may be replaced later) plus, with ``pending_pos >= 0``, the token the forward
        still resolves into ``input_ids[pending_pos]`` (the overlap loop's pending token)."""
        finish: tuple[int, ...] = ()
        if self.min_new_tokens > 0:
            eos = () if self.ignore_eos else tuple(eos_token_ids)
            finish = tuple(sorted({*eos, *self.stop_token_ids}))
        return RowPenalties(
            frequency=float(self.frequency_penalty), presence=float(self.presence_penalty),
            repetition=float(self.repetition_penalty), logit_bias=self.logit_bias or None,
            min_new_tokens=self.min_new_tokens, finish_ids=finish,
            output_ids=output_ids, n_out=len(output_ids), pending_pos=pending_pos,
        )


_INT64 = 1 << 63


def _is_int(v: Any) -> bool:
    """An integer that fits the wire (msgpack int64): a bool is not one."""
    return isinstance(v, int) and not isinstance(v, bool) and -_INT64 <= v < _INT64


def _is_number(v: Any) -> bool:
    """A finite number that fits the wire (an int within int64)."""
    if isinstance(v, int):
        return _is_int(v)
    return isinstance(v, float) and math.isfinite(v)


def _logit_bias(bias: Any, vocab_size: int | None) -> dict[int, float]:
    """OpenAI's ``logit_bias``: ``{"<token id>": bias}``, bias in [-100, 100]; keys become ints."""
    if not isinstance(bias, dict):
        raise InvalidRequest("logit_bias must be an object mapping token ids to biases", param="logit_bias")
    out: dict[int, float] = {}
    for k, v in bias.items():
        try:
            tid = int(k) if isinstance(k, (str, int)) and not isinstance(k, bool) else -1
        except ValueError:
            tid = -1
        if tid < 0 or (vocab_size is not None and tid >= vocab_size) or (isinstance(k, str) and k.strip() != str(tid)):
            bound = f" in [0, {vocab_size})" if vocab_size is not None else ""
            raise InvalidRequest(f"logit_bias keys must be token ids{bound}, got {k!r}", param="logit_bias")
        if not _is_number(v) or not -100.0 <= v <= 100.0:
            raise InvalidRequest(f"logit_bias values must be numbers in [-100, 100], got {v!r} for token {k}",
                                 param="logit_bias")
        out[tid] = float(v)
    return out
