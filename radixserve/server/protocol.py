"""Request bodies of the OpenAI and SGLang-native APIs, and OpenAI-shaped errors.

Bodies are parsed by hand (``parse_body``) so that every failure is a 400 in OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}``, never FastAPI's 422. Unknown fields are
accepted and ignored, as vLLM and SGLang do (clients send ``extra_body`` fields freely).
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError


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


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    n: int = Field(1, ge=1, le=64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = None
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    priority: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None

    def sampling_params(self, max_new_tokens: int, logprobs: bool, top_logprobs: int) -> dict[str, Any]:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError(f"{name} is not supported", param=name, code="unsupported_parameter")
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
        }

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    return_token_ids: bool = False  # vLLM's extension: the choices carry token_ids (and prompt_token_ids)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None

    def to_template(self) -> dict[str, Any]:
        d = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):  # content parts: keep the text ones
            parts = []
            for p in self.content:
                if p.get("type") != "text" or not isinstance(p.get("text"), str):
                    raise APIError("only text content parts are supported", param="messages")
                parts.append(p["text"])
            d["content"] = "".join(parts)
        elif self.content is None:
            d["content"] = ""
        return d


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class GenerateRequest(BaseModel):
    """SGLang's native ``/generate`` body."""

    model_config = ConfigDict(extra="allow")
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    rid: str | list[str] | None = None
    priority: int | None = None
    return_logprob: bool = False
    top_logprobs_num: int = Field(0, ge=0, le=20)


class AbortRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    rid: str = ""
    abort_all: bool = False


M = TypeVar("M", bound=BaseModel)


def parse_body(raw: bytes, model: type[M]) -> M:
    try:
        data = json.loads(raw) if raw.strip() else None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"malformed JSON body: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError("the request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(x) for x in err.get("loc", ()) if not isinstance(x, int)]
        # NOTE: for unions pydantic appends the tried type to loc; the field is the first part.
        param = loc[0] if loc else None
        where = ".".join(str(x) for x in err.get("loc", ()))
        raise APIError(f"{where}: {err.get('msg')}" if where else str(err.get("msg")), param=param,
                       code="invalid_value" if err.get("type") != "missing" else "missing_required_parameter"
                       ) from None
