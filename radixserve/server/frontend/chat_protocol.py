"""The chat completion request body (``/v1/chat/completions``, and ``/tokenize`` of a chat): its
messages, tools, response formats and template variables, validated as ``protocol.py`` says."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from radixserve.sched.noop_fields import CHAT
from radixserve.server.frontend.protocol import (
    _CHAT_UNSUPPORTED,
    INT64_MAX,
    APIError,
    _SamplingFields,
    unsupported,
)

_ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra={"additionalProperties": False})
    role: str = Field(description="system, developer, user, assistant or tool.", json_schema_extra={"enum": list(_ROLES)})
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    refusal: str | None = Field(None, description="An assistant message's refusal: accepted, not templated.")
    tool_calls: list[dict[str, Any]] | None = Field(None, description="An assistant message's calls.")
    tool_call_id: str | None = Field(None, description="A tool message: the call it answers.")

    def to_template(self) -> dict[str, Any]:
        d = self.model_dump(exclude_none=True, exclude={"refusal"})
        for call in d.get("tool_calls") or []:  # templates take the arguments as an object
            fn = call.get("function")
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except ValueError:
                    pass
        if isinstance(self.content, list):  # content parts: keep the text ones
            parts = []
            for p in self.content:
                if p.get("type") != "text" or not isinstance(p.get("text"), str):
                    raise unsupported("messages", "only text content parts are supported")
                parts.append(p["text"])
            d["content"] = "".join(parts)
        elif self.content is None:
            d["content"] = ""
        return d


# what the server passes to a chat template itself
_TEMPLATE_VARIABLES = ("messages", "add_generation_prompt", "tools", "bos_token", "eos_token")


def check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    clash = sorted(set(kwargs or {}) & set(_TEMPLATE_VARIABLES))
    if clash:
        raise APIError(f"chat_template_kwargs may not set {', '.join(clash)} (the server sets them)",
                       param="chat_template_kwargs", code="invalid_value")


class ChatCompletionRequest(_SamplingFields):
    NOOP_FIELDS = CHAT
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = Field(None, description="Function tools the model may call.")
    tool_choice: str | dict[str, Any] | None = Field(
        None, description='none, auto (needs --tool-call-parser), required, or {"type": "function", '
        '"function": {"name": ...}}; default auto with tools.')
    parallel_tool_calls: bool | None = Field(None, description="Whether a forced answer may hold several calls.")
    modalities: list[str] | None = Field(None, description='Only ["text"].')
    metadata: dict[str, str] | None = Field(None, description="Accepted and not stored (store is refused).")
    store: bool | None = Field(None, description="Only false: completions are not stored.")
    service_tier: str | None = Field(None, description='Only "auto" or "default".')
    prediction: dict[str, Any] | None = Field(
        None, description="Predicted output: a latency hint, accepted and not used (the output is the same).")
    prompt_cache_key: str | None = Field(None, description="Accepted; the radix cache reuses prefixes by itself.")
    prompt_cache_retention: str | None = Field(None, description="Accepted; the radix cache keeps what fits.")
    safety_identifier: str | None = Field(None, description="The tenant when user is not set.")
    reasoning_effort: str | None = Field(
        None, description="Passed to the chat template (with --reasoning-parser; refused without one).")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extra variables for the chat template (e.g. enable_thinking).")
    separate_reasoning: bool = Field(
        True, description="SGLang's: with --reasoning-parser, answer the reasoning apart (false: all as content).")

    def check(self) -> None:
        super().check()
        check_template_kwargs(self.chat_template_kwargs)
        if self.reasoning_effort is not None and self.reasoning_effort not in ("minimal", "low", "medium", "high"):
            raise APIError("reasoning_effort is one of minimal, low, medium, high", param="reasoning_effort",
                           code="invalid_value")
        extra = self.model_extra or {}
        for name, why in _CHAT_UNSUPPORTED.items():
            if (getattr(self, name, None) if name in type(self).model_fields else extra.get(name)) is not None:
                raise unsupported(name, why)
        self._check_tools()
        if self.modalities is not None and self.modalities != ["text"]:
            raise unsupported("modalities", 'only ["text"] is supported')
        if self.store:
            raise unsupported("store", "completions are not stored")
        if self.service_tier not in (None, "auto", "default"):
            raise unsupported("service_tier", 'only "auto" and "default" are supported')
        if self.metadata is not None and len(self.metadata) > 16:
            raise APIError("metadata has at most 16 keys", param="metadata", code="invalid_value")
        for i, m in enumerate(self.messages):
            if m.role not in _ROLES:
                raise APIError(f"messages[{i}].role must be one of {', '.join(_ROLES)}, got {m.role!r}",
                               param=f"messages[{i}].role", code="invalid_value")
            if m.content is None and m.role != "assistant":  # as OpenAI: only an assistant turn may lack it
                raise APIError(f"messages[{i}].content is required for a {m.role} message",
                               param=f"messages[{i}].content", code="missing_required_parameter")
            if m.role == "tool" and not m.tool_call_id:
                raise APIError(f"messages[{i}].tool_call_id is required for a tool message",
                               param=f"messages[{i}].tool_call_id", code="missing_required_parameter")
            if m.tool_calls is not None and m.role != "assistant":
                raise APIError(f"messages[{i}].tool_calls belongs to an assistant message",
                               param=f"messages[{i}].tool_calls", code="invalid_value")
            unknown = sorted(m.model_extra or {})
            if unknown:
                raise APIError(f"Unknown parameter: 'messages[{i}].{unknown[0]}'.", param=f"messages[{i}].{unknown[0]}",
                               code="unknown_parameter")


    def _check_tools(self) -> None:
        for i, t in enumerate(self.tools or []):
            fn = t.get("function")
            if t.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise APIError(f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., ...}}}}',
                               param=f"tools[{i}]", code="invalid_value")
            params = fn.get("parameters")
            if params is not None and not isinstance(params, dict):
                raise APIError(f"tools[{i}].function.parameters must be a JSON schema object",
                               param=f"tools[{i}].function.parameters", code="invalid_value")
        if self.parallel_tool_calls is not None and not self.tools:
            raise APIError("parallel_tool_calls needs tools", param="parallel_tool_calls", code="invalid_value")
        choice = self.tool_choice
        if choice is None or choice == "none":
            return
        if not self.tools:
            raise APIError("tool_choice needs tools", param="tool_choice", code="invalid_value")
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
            if name not in self.tool_names():
                raise APIError(f"tool_choice names no function among the tools: {name!r}", param="tool_choice",
                               code="invalid_value")
        elif choice not in ("auto", "required"):
            raise APIError("tool_choice is none, auto, required or a named function", param="tool_choice",
                           code="invalid_value")

    def tool_names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools or []}

    def forced_tools(self) -> list[dict[str, Any]] | None:
        """The tools an answer must call one of (tool_choice required or named), else None."""
        choice = self.tool_choice
        if isinstance(choice, dict):
            name = choice["function"]["name"]
            return [t for t in self.tools or [] if t["function"]["name"] == name]
        return list(self.tools or []) if choice == "required" else None
