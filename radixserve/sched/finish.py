"""Finish reasons as types, one definition from the scheduler to the HTTP response.

They are tagged msgspec structs, so they cross the process boundary as they are (msgpack, the tag
in ``type``). ``to_json`` matches SGLang's ``meta_info.finish_reason`` and ``openai_reason``
OpenAI's ``finish_reason``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec


class BaseFinishReason(msgspec.Struct, frozen=True, tag_field="type"):
    openai_reason: ClassVar[str] = "stop"
    is_abort: ClassVar[bool] = False

    def to_json(self) -> dict[str, Any]:
        raise NotImplementedError


class FINISH_STOP(BaseFinishReason, frozen=True, tag="stop"):
    """EOS, a stop token id or a stop string."""

    matched: int | str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"type": "stop", "matched": self.matched}


class FINISH_LENGTH(BaseFinishReason, frozen=True, tag="length"):
    """max_new_tokens reached, or the context is full."""

    length: int = 0
    openai_reason: ClassVar[str] = "length"

    def to_json(self) -> dict[str, Any]:
        return {"type": "length", "length": self.length}


class FINISH_ABORT(BaseFinishReason, frozen=True, tag="abort"):
    """The request was refused or cut short; ``status_code`` is what HTTP should answer."""

    message: str = "aborted"
    status_code: int = 400
    err_type: str = "invalid_request_error"
    code: str = "invalid_request"
    param: str | None = None
    openai_reason: ClassVar[str] = "abort"
    is_abort: ClassVar[bool] = True

    def to_json(self) -> dict[str, Any]:
        return {"type": "abort", "message": self.message, "status_code": self.status_code, "code": self.code}


# what a finish reason field holds on the wire (msgspec decodes the tag into the right class)
FinishReason = FINISH_STOP | FINISH_LENGTH | FINISH_ABORT
