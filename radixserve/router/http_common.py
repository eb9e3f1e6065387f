"""What the router's request paths (``router.py``, and ``pd.py`` for prefill/decode pairs) share
about the HTTP exchange: errors in OpenAI's shape, the JSON body check, and the mark of a request
whose response head the client already has (after which nothing can be retried)."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

STREAMED = web.RequestKey("radixserve_streamed", bool)  # the client has been sent the response head


def error_body(message: str, status: int, code: str, err_type: str | None = None) -> dict[str, Any]:
    """An error in OpenAI's shape, as the workers write theirs."""
    if err_type is None:
        err_type = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": err_type, "param": None, "code": code}, "object": "error"}


def error_response(message: str, status: int, code: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(error_body(message, status, code), status=status, headers=headers)


def json_object(raw: bytes) -> dict[str, Any] | web.Response:
    """The request body as a JSON object, or the 400 to answer."""
    try:
        parsed = json.loads(raw)
    except (ValueError, RecursionError) as e:
        return error_response(f"malformed JSON body: {e}", 400, "invalid_json")
    if not isinstance(parsed, dict):
        return error_response("the request body must be a JSON object", 400, "invalid_json")
    return parsed
