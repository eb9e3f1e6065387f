"""Three pieces of plain ASGI sit in front of the app (``Guard``):
- an HTTP/2 connection preface (``PRI * HTTP/2.0``, what routers send to probe for gRPC) gets a
  505 with ``Connection: close``; uvicorn closes that connection and keeps serving HTTP/1.1;
- with ``--api-key``, every endpoint but ``/health`` wants ``Authorization: Bearer <key>``
  (``/openapi.json`` included), or
  ``X-API-Key``, except the dashboard's page and static files, which hold no data: the page
  sends the key with its ``/dashboard/state`` calls (docs/dashboard.md); with
  ``--admin-api-key``, ``/flush_cache``, ``/abort_request`` and ``/set_schedule_policy`` want that
  key instead (radixserve/auth.py);
- a request body over ``--max-request-body-bytes`` gets a 413: at once from its Content-Length,
  or, chunked, as soon as what arrived passes the limit.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from radixserve.auth import Access
from radixserve.server.frontend.protocol import APIError

DEFAULT_MAX_BODY = 16 * 1024 * 1024


def body_too_large(limit: int) -> APIError:
    return APIError(f"the request body is larger than this server accepts ({limit} bytes; "
                    "--max-request-body-bytes)", 413, code="request_too_large")


class Guard:
    def __init__(self, app: ASGIApp, access: Access, max_body: int = DEFAULT_MAX_BODY) -> None:
        self.app = app
        self.access = access
        self.max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            if scope.get("method") == "PRI" or str(scope.get("http_version", "")).startswith("2"):
                err = APIError("HTTP/2 is not supported on this port; use HTTP/1.1", 505, "invalid_request_error",
                               "http2_not_supported")
                await _send_json(send, 505, err.to_json(), close=True)
                return
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers") or []}
            refused = self.access.refusal(scope.get("method", ""), scope.get("path", ""), headers)
            if refused is not None:
                err = APIError(refused, 401, "invalid_request_error", "invalid_api_key")
                await _send_json(send, 401, err.to_json())
                return
            length = headers.get("content-length")
            if length is not None and length.isdigit() and int(length) > self.max_body:
                await _send_json(send, 413, body_too_large(self.max_body).to_json(), close=True)
                return
            receive = self._limited(receive)
        await self.app(scope, receive, send)

    def _limited(self, receive: Receive) -> Receive:
        """``receive`` that raises a 413 ``APIError`` (answered by the app's handler) once the body
        passes the limit: a chunked body has no Content-Length to check first."""
        seen = 0

        async def limited() -> Any:
            nonlocal seen
            msg = await receive()
            if msg.get("type") == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_body:
                    raise body_too_large(self.max_body)
            return msg

        return limited


async def _send_json(send: Send, status: int, body: dict[str, Any], close: bool = False) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})
