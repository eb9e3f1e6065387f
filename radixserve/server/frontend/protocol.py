"""Request bodies of the OpenAI and SGLang-native APIs, and OpenAI-shaped errors.

Bodies are parsed by hand (``parse_body``) so that every failure is a 400 in OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}``, never FastAPI's 422 and never a 5xx: the JSON
is decoded strictly (no NaN / Infinity, valid UTF-8, no lone surrogates, nesting bounded), then
validated by the pydantic models below, which are also what ``/openapi.json`` documents.

Every field is honoured or refused (docs/api.md has the list): a field a model does not declare is a
400 ``unknown_parameter``, as OpenAI answers it, except the extension fields each model lists in
``EXTRA_FIELDS`` (scheduling and router fields, read from ``model_extra`` by ``sched_fields`` and
``pd_fields``) and the fields SGLang's or vLLM's schema defines that this server does not act on
(``NOOP_FIELDS``, ``sched/noop_fields.py``: accepted at their no-op values, dropped before
validation); a field that names something this server does not do is a 400 ``unsupported``.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal, TypeVar

import msgspec
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from radixserve.sched.noop_fields import COMPLETION, NATIVE, noop_schema, refusal

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


class APIError(Exception):
    def __init__(
        self,
        message: str,
        status_code: int = 400,
        err_type: str = "invalid_request_error",
        code: str = "invalid_request",
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.err_type = err_type
        self.code = code
        self.param = param
        self.headers = headers

    def to_json(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.code}}


def unsupported(param: str, what: str) -> APIError:
    return APIError(f"{param}: {what}", param=param, code="unsupported")


_MS = {"type": "number", "exclusiveMinimum": 0}
_RANK = {"type": "integer", "minimum": 0}
# extension fields kept in ``model_extra`` (their readers validate them): name -> JSON schema
_SCHED_EXTRA: dict[str, dict[str, Any]] = {
    "tpot_slo_ms": {**_MS, "description": "TPOT deadline in ms (header x-slo-tpot-ms wins)."},
    "data_parallel_rank": {**_RANK, "description": "--dp-size: run on this rank (a DP-aware router sets it)."},
    "data_parallel_rank_decode": {**_RANK, "description": "Disaggregation: the decode worker's rank."},
    "bootstrap_host": {"type": "string", "description": "Disaggregation: the prefill worker's host."},
    "bootstrap_port": {"type": "integer", "minimum": 1, "maximum": 65535,
                       "description": "Disaggregation: the prefill worker's bootstrap port."},
    "bootstrap_room": {"type": "integer", "minimum": 0, "description": "Disaggregation: the KV hand-over's room."},
}
_OPENAI_EXTRA = {**_SCHED_EXTRA, "ttft_slo_ms": {**_MS, "description": "TTFT deadline in ms (header x-ttft-slo-ms wins)."}}
_NATIVE_EXTRA = {
    **_SCHED_EXTRA,
    "deadline_ms": {**_MS, "description": "TTFT deadline in ms (header x-ttft-slo-ms wins)."},
    "tenant": {"type": "string", "description": "Tenant for vtc fairness (header x-tenant wins)."},
}


class _Body(BaseModel):
    """A request body: declared fields, plus the extension fields of ``EXTRA_FIELDS`` (in ``model_extra``)."""

    model_config = ConfigDict(extra="allow", strict=True)  # JSON types as sent: no "yes" for true, no 1.0 for 1
    EXTRA_FIELDS: ClassVar[dict[str, dict[str, Any]]] = {}
    NOOP_FIELDS: ClassVar[dict[str, tuple[Any, ...]]] = {}  # accepted at these values only (noop_fields.py)
    ALLOW_UNKNOWN: ClassVar[bool] = False  # True: any other field is passed on (set_schedule_policy)

    def check(self) -> None:
        """Refusals that need more than one field's type (called by ``parse_body``)."""

    @classmethod
    def known(cls) -> set[str]:
        return set(cls.model_fields) | set(cls.EXTRA_FIELDS) | set(cls.NOOP_FIELDS)


def _extra_schema(schema: dict[str, Any], model: type[BaseModel]) -> None:
    extra = getattr(model, "EXTRA_FIELDS", {})
    props = schema.setdefault("properties", {})
    props.update(extra)
    for name, accepted in getattr(model, "NOOP_FIELDS", {}).items():
        props[name] = noop_schema(accepted)
    schema["additionalProperties"] = False


def _generate_schema(schema: dict[str, Any], model: type[BaseModel]) -> None:
    _extra_schema(schema, model)
    schema["oneOf"] = [{"required": ["text"]}, {"required": ["input_ids"]}]  # exactly one of the two


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False
    include_obfuscation: bool | None = Field(None, description="Accepted; no obfuscation padding is sent.")


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="Absent: any JSON object.")
    strict: bool | None = Field(None, description="Accepted: the output always follows the schema.")


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class _SamplingFields(_Body):
    model_config = ConfigDict(extra="allow", json_schema_extra=_extra_schema)
    EXTRA_FIELDS = _OPENAI_EXTRA
    model: str | None = None
    n: int = Field(1, ge=1, le=64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX - 64)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(
        None, description="Token id (as a string) -> bias in [-100, 100], added to the logit.")
    user: str | None = Field(None, description="The tenant for vtc fairness (header x-tenant wins).")
    # extensions (vLLM's / SGLang's names)
    top_k: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX, description="-1 or 0: off.")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    min_tokens: int = Field(0, ge=0, le=INT64_MAX,
                            description="EOS and stop_token_ids cannot end the output before this many tokens.")
    repetition_penalty: float | None = Field(
        None, gt=0.0, le=2.0, description="SGLang's: logits of tokens already generated are divided (positive) "
        "or multiplied (negative) by it.")
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    priority: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    response_format: ResponseFormat | None = Field(
        None, description="Structured output: json_object (any JSON object) or json_schema (the output follows it).")
    regex: str | None = Field(None, description="SGLang's: the output matches this regular expression.")
    ebnf: str | None = Field(None, description="SGLang's: the output follows this grammar (GBNF or Lark).")

    def grammar_params(self) -> dict[str, Any]:
        """``response_format``, ``regex`` and ``ebnf`` as SamplingParams fields (which allow one)."""
        out: dict[str, Any] = {}
        rf = self.response_format
        if rf is not None and rf.type != "json_schema" and rf.json_schema is not None:
            raise APIError(f"response_format.json_schema is only allowed with type json_schema, not {rf.type}",
                           param="response_format.json_schema", code="invalid_value")
        if rf is not None and rf.type == "json_object":
            out["json_schema"] = '{"type": "object"}'
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise APIError("response_format of type json_schema needs a json_schema object",
                               param="response_format.json_schema", code="missing_required_parameter")
            schema = rf.json_schema.schema_
            out["json_schema"] = json.dumps(schema if schema is not None else {"type": "object"})
        if self.regex is not None:
            out["regex"] = self.regex
        if self.ebnf is not None:
            out["ebnf"] = self.ebnf
        return out

    def sampling_params(self, max_new_tokens: int, logprobs: bool, top_logprobs: int) -> dict[str, Any]:
        if self.min_tokens > max_new_tokens:
            raise APIError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({max_new_tokens})",
                           param="min_tokens", code="invalid_value")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return {
            "max_new_tokens": max_new_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": -1 if self.top_k in (None, 0) else self.top_k,
            "min_p": self.min_p or 0.0,
            "stop": stop,
            "stop_token_ids": list(self.stop_token_ids or []),
            "ignore_eos": self.ignore_eos,
            "seed": self.seed,
            "skip_special_tokens": self.skip_special_tokens,
            "logprobs": logprobs,
            "top_logprobs_num": top_logprobs,
            "frequency_penalty": self.frequency_penalty or 0.0,
            "presence_penalty": self.presence_penalty or 0.0,
            "repetition_penalty": 1.0 if self.repetition_penalty is None else self.repetition_penalty,
            "logit_bias": dict(self.logit_bias) if self.logit_bias else None,
            "min_new_tokens": self.min_tokens,
            **self.grammar_params(),
        }

    def check(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options is only allowed when stream is true", param="stream_options")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    NOOP_FIELDS = COMPLETION
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1, le=INT64_MAX)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = Field(None, description="Not supported: refused unless empty.")
    best_of: int | None = Field(
        None, ge=1, le=64, description="Samples drawn per prompt; the n of highest total logprob are returned.")
    return_token_ids: bool = False  # vLLM's extension: the choices carry token_ids (and prompt_token_ids)

    def check(self) -> None:
        super().check()
        if self.suffix:
            raise unsupported("suffix", "insertion (suffix) is not supported")
        if self.best_of is not None and self.best_of < self.n:
            raise APIError("best_of must be >= n", param="best_of", code="invalid_value")
        if self.samples > self.n and self.stream:
            raise APIError("best_of > n cannot be streamed (the best are known at the end)", param="best_of",
                           code="invalid_value")

    @property
    def samples(self) -> int:
        """Completions drawn per prompt (``best_of``, default ``n``)."""
        return self.best_of or self.n


# fields OpenAI defines for chat that this server does not do: a 400 naming them
_CHAT_UNSUPPORTED = {
    "functions": "the legacy functions field is not supported: use tools",
    "function_call": "the legacy function_call field is not supported: use tool_choice",
    "audio": "audio output is not supported",
    "web_search_options": "web search is not supported",
    "verbosity": "verbosity is not supported by this model",
}


class GenerateRequest(_Body):
    """SGLang's native ``/generate`` body."""

    model_config = ConfigDict(extra="allow", json_schema_extra=_generate_schema)
    EXTRA_FIELDS = _NATIVE_EXTRA
    NOOP_FIELDS = NATIVE
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = Field(
        None, description="SamplingParams fields (docs/api.md); one object, or one per prompt.")
    stream: bool = False
    rid: str | list[str] | None = None
    priority: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    return_logprob: bool = False
    top_logprobs_num: int = Field(0, ge=0, le=20)
    logprob_start_len: int | None = Field(
        None, ge=-1, le=INT64_MAX,
        description="With return_logprob: the prompt logprobs from this token on (meta_info.input_token_logprobs); "
                    "-1 (or none): the output tokens' only.")
    return_text_in_logprobs: bool = Field(False, description="Logprob entries carry each token's text (else null).")


class AbortRequest(_Body):
    model_config = ConfigDict(extra="allow", json_schema_extra=_extra_schema)
    rid: str = ""
    abort_all: bool = False


class SchedulePolicyRequest(_Body):
    """``/set_schedule_policy``: ``schedule_policy`` and/or the policy's parameters (docs/qos.md);
    the scheduler validates the names and values."""

    model_config = ConfigDict(extra="allow", json_schema_extra={"additionalProperties": True})
    ALLOW_UNKNOWN = True
    schedule_policy: str | None = None

    def check(self) -> None:
        # NOTE: the parameters travel to the scheduler as msgpack, whose integers are 64-bit; a
        # bigger one would fail there as an internal error, so it is refused here by name.
        for name, value in (self.model_extra or {}).items():
            if not _ints_fit_64_bits(value):
                raise APIError(f"{name}: integers must fit in 64 bits", param=name, code="invalid_value")


def _ints_fit_64_bits(value: Any) -> bool:
    if isinstance(value, int) and not isinstance(value, bool):
        return INT64_MIN <= value <= INT64_MAX
    if isinstance(value, dict):
        return all(_ints_fit_64_bits(v) for v in value.values())
    if isinstance(value, list):
        return all(_ints_fit_64_bits(v) for v in value)
    return True


M = TypeVar("M", bound=_Body)


def decode_json(raw: bytes) -> Any:
    """Strict JSON: invalid UTF-8, lone surrogates, NaN / Infinity, numbers out of float range and
    nesting past the decoder's depth limit (a few hundred levels) are 400s."""
    try:
        return msgspec.json.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError, ValueError) as e:
        raise APIError(f"malformed JSON body: {e}", code="invalid_json") from None


def parse_body(raw: bytes, model: type[M]) -> M:
    data = decode_json(raw) if raw.strip() else None
    if not isinstance(data, dict):
        raise APIError("the request body must be a JSON object", code="invalid_json")
    for name in [k for k in data if k in model.NOOP_FIELDS]:
        why = refusal(model.NOOP_FIELDS, name, data[name])
        if why is not None:
            raise unsupported(name, why)
        del data[name]
    known = model.known()
    unknown = [k for k in data if k not in known]
    if unknown and not model.ALLOW_UNKNOWN:
        name = str(unknown[0])
        if name in _CHAT_UNSUPPORTED:
            raise unsupported(name, _CHAT_UNSUPPORTED[name])
        raise APIError(f"Unknown parameter: '{name}'.", param=name, code="unknown_parameter")
    try:
        body = model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(x) for x in err.get("loc", ()) if not isinstance(x, int)]
        # NOTE: for unions pydantic appends the tried type to loc; the field is the first part.
        param = loc[0] if loc else None
        where = ".".join(str(x) for x in err.get("loc", ()))
        raise APIError(f"{where}: {err.get('msg')}" if where else str(err.get("msg")), param=param,
                       code="invalid_value" if err.get("type") != "missing" else "missing_required_parameter"
                       ) from None
    body.check()
    return body
