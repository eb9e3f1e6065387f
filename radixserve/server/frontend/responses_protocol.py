"""The Responses API's request body and its translation into a chat completion request: the
instructions, the conversation so far and the input items become chat messages, the function tools,
``tool_choice``, ``text.format`` and ``reasoning.effort`` their chat forms; anything that has no chat
form is refused naming the field (responses_api.py serves it)."""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field

from radixserve.server.frontend.protocol import (
    _OPENAI_EXTRA,
    INT64_MAX,
    INT64_MIN,
    APIError,
    StreamOptions,
    _Body,
    _extra_schema,
    unsupported,
)

STORE_SIZE = 1024  # stored responses kept per server (the oldest go first)
LOGPROBS = "message.output_text.logprobs"


class ResponsesRequest(_Body):
    model_config = ConfigDict(extra="allow", json_schema_extra=_extra_schema)
    EXTRA_FIELDS = _OPENAI_EXTRA
    model: str | None = None
    input: str | list[dict[str, Any]] = Field(description="A user message, or a list of input items.")
    instructions: str | None = Field(None, description="A system message first (not carried to a later turn).")
    previous_response_id: str | None = Field(None, description="Continue a stored response's conversation.")
    max_output_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    include: list[str] | None = Field(None, description=f'Only "{LOGPROBS}".')
    tools: list[dict[str, Any]] | None = Field(None, description="Function tools (no built-in tools).")
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = Field(None, description='{"format": {"type": "text" | "json_object" | "json_schema", ...}}')
    reasoning: dict[str, Any] | None = Field(None, description='{"effort": ..., "summary": "auto"} (needs --reasoning-parser)')
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool = Field(True, description=f"Keep the response in this server's memory (the newest {STORE_SIZE}).")
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = Field(None, description="Accepted; the radix cache reuses prefixes by itself.")
    truncation: str | None = Field(None, description='Only "disabled": a too long input is refused.')
    background: bool | None = Field(None, description="Only false.")
    service_tier: str | None = Field(None, description='Only "auto" or "default".')
    max_tool_calls: int | None = Field(None, description="Not supported (null only).")
    # extensions, as in chat completions
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX - 64)
    top_k: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    priority: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)

    def check(self) -> None:
        if self.truncation not in (None, "disabled"):
            raise unsupported("truncation", 'only "disabled" is supported: a too long input is refused')
        if self.background:
            raise unsupported("background", "background responses are not supported")
        if self.max_tool_calls is not None:
            raise unsupported("max_tool_calls", "max_tool_calls is not supported")
        if self.service_tier not in (None, "auto", "default"):
            raise unsupported("service_tier", 'only "auto" and "default" are supported')
        for i, item in enumerate(self.include or []):
            if item != LOGPROBS:
                raise unsupported(f"include[{i}]", f'only "{LOGPROBS}" can be included')
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options is only allowed when stream is true", param="stream_options")


# --- input items -> chat messages --------------------------------------------------------------------
def _text(value: Any, param: str) -> str:
    """A string, or text parts (input_text / output_text) joined."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        out = []
        for k, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                    or not isinstance(part.get("text"), str):
                raise unsupported(f"{param}[{k}]", "only text parts (input_text, output_text) are supported")
            out.append(part["text"])
        return "".join(out)
    raise APIError(f"{param} must be a string or a list of text parts", param=param, code="invalid_type")


def _need_str(item: dict[str, Any], key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(f"{param}.{key} must be a string", param=f"{param}.{key}", code="missing_required_parameter")
    return value


def input_messages(inp: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(inp, str):
        return [{"role": "user", "content": inp}]
    if not inp:
        raise APIError("input must not be empty", param="input", code="invalid_value")
    msgs: list[dict[str, Any]] = []
    for i, item in enumerate(inp):
        param = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(f"{param}.role must be user, system, developer or assistant, got {role!r}",
                               param=f"{param}.role", code="invalid_value")
            msgs.append({"role": role, "content": _text(item.get("content"), f"{param}.content")})
        elif kind == "function_call":
            call = {"id": _need_str(item, "call_id", param), "type": "function",
                    "function": {"name": _need_str(item, "name", param),
                                 "arguments": _need_str(item, "arguments", param)}}
            if msgs and msgs[-1]["role"] == "assistant":  # calls of the same turn
                msgs[-1].setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            msgs.append({"role": "tool", "tool_call_id": _need_str(item, "call_id", param),
                         "content": _text(item.get("output"), f"{param}.output")})
        elif kind != "reasoning":  # earlier reasoning is not shown to the model again
            raise unsupported(f"{param}.type", f"input items of type {kind!r} are not supported (message, "
                                               "function_call, function_call_output and reasoning are)")
    return msgs


def chat_body(body: ResponsesRequest, history: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat completion request this response runs as."""
    messages = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    messages += history + input_messages(body.input)
    # top_logprobs asks for logprobs as include does
    logprobs = LOGPROBS in (body.include or []) or bool(body.top_logprobs)
    out: dict[str, Any] = {"messages": messages, "stream": body.stream, "logprobs": logprobs}
    for key in ("model", "temperature", "top_p", "parallel_tool_calls", "user", "safety_identifier",
                "prompt_cache_key", "metadata", "seed", "top_k", "min_p", "repetition_penalty", "priority"):
        value = getattr(body, key)
        if value is not None:
            out[key] = value
    if body.max_output_tokens is not None:
        out["max_completion_tokens"] = body.max_output_tokens
    if out["logprobs"] and body.top_logprobs:
        out["top_logprobs"] = body.top_logprobs
    out.update(body.model_extra or {})  # scheduling extensions (ttft_slo_ms, bootstrap fields)
    if body.tools:
        out["tools"] = [_chat_tool(t, i) for i, t in enumerate(body.tools)]
    if body.tool_choice is not None:
        out["tool_choice"] = _chat_tool_choice(body.tool_choice)
    fmt = _text_format(body.text)
    if fmt is not None:
        out["response_format"] = fmt
    effort = _reasoning_effort(body.reasoning)
    if effort is not None:
        out["reasoning_effort"] = effort
    return out


def _chat_tool(t: dict[str, Any], i: int) -> dict[str, Any]:
    if t.get("type") != "function":
        raise unsupported(f"tools[{i}].type", "only function tools are supported (no built-in tools such as "
                                              "web_search or file_search)")
    unknown = sorted(set(t) - {"type", "name", "description", "parameters", "strict"})
    if unknown:
        raise APIError(f"Unknown parameter: 'tools[{i}].{unknown[0]}'.", param=f"tools[{i}].{unknown[0]}",
                       code="unknown_parameter")
    fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
    if not isinstance(fn.get("name"), str):
        raise APIError(f"tools[{i}].name must be a string", param=f"tools[{i}].name", code="missing_required_parameter")
    return {"type": "function", "function": fn}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise unsupported("tool_choice", 'tool_choice is none, auto, required or {"type": "function", "name": ...}')


def _text_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    if not text:
        return None
    unknown = sorted(set(text) - {"format", "verbosity"})
    if unknown:
        raise APIError(f"Unknown parameter: 'text.{unknown[0]}'.", param=f"text.{unknown[0]}", code="unknown_parameter")
    if text.get("verbosity") is not None:
        raise unsupported("text.verbosity", "verbosity is not supported by this model")
    fmt = text.get("format")
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("json_object", "json_schema"):
        raise APIError("text.format.type is text, json_object or json_schema", param="text.format",
                       code="invalid_value")
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    if not isinstance(fmt.get("name"), str):
        raise APIError("text.format.name is required for json_schema", param="text.format.name",
                       code="missing_required_parameter")
    schema = {k: fmt[k] for k in ("name", "description", "schema", "strict") if fmt.get(k) is not None}
    return {"type": "json_schema", "json_schema": schema}


def _reasoning_effort(reasoning: dict[str, Any] | None) -> str | None:
    if not reasoning:
        return None
    unknown = sorted(set(reasoning) - {"effort", "summary", "generate_summary"})
    if unknown:
        raise APIError(f"Unknown parameter: 'reasoning.{unknown[0]}'.", param=f"reasoning.{unknown[0]}",
                       code="unknown_parameter")
    for key in ("summary", "generate_summary"):
        if reasoning.get(key) not in (None, "auto"):
            raise unsupported(f"reasoning.{key}", 'only "auto": the reasoning comes whole, as reasoning_text')
    return reasoning.get("effort")
