"""Finish reasons as types. ``to_json`` matches SGLang's ``meta_info.finish_reason`` and
``openai_reason`` OpenAI's ``finish_reason``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class BaseFinishReason:
    openai_reason: str = "stop"

    def to_json(self) -> dict[str, Any]:
        raise NotImplementedError


@dataclass
class FINISH_STOP(BaseFinishReason):
    """EOS, a stop token id or a stop string."""

    matched: int | str | None = None
    openai_reason = "stop"

    def to_json(self) -> dict[str, Any]:
        return {"type": "stop", "matched": self.matched}


@dataclass
class FINISH_LENGTH(BaseFinishReason):
    """max_new_tokens reached, or the context is full."""

    length: int = 0
    openai_reason = "length"

    def to_json(self) -> dict[str, Any]:
        return {"type": "length", "length": self.length}


@dataclass
class FINISH_ABORT(BaseFinishReason):
    """The request was refused or cut short; ``status_code`` is what HTTP should answer."""

    message: str = "aborted"
    status_code: int = 400
    err_type: str = "invalid_request_error"
    code: str = "invalid_request"
    param: str | None = None
    openai_reason = "abort"

    def to_json(self) -> dict[str, Any]:
        return {"type": "abort", "message": self.message, "status_code": self.status_code, "code": self.code}
