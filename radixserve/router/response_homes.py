"""Which worker holds each stored response of the Responses API.

A worker keeps the responses it answered (``store``) in its own memory: a request that continues
one (``previous_response_id``) must reach that worker, and so must ``GET`` / ``DELETE
/v1/responses/{id}`` and its ``input_items``. Workers name each response in an ``x-response-id``
header, so the router learns the home of every response it relays without reading bodies; it keeps
the newest ``size`` of them. A request whose response's home is gone (or unknown: made before this
router started) is routed as any other (the worker answers 404 if it does not have it); a read of
an unknown id asks the workers in turn.
"""

from __future__ import annotations

import json
from collections import OrderedDict

import aiohttp
from aiohttp import web

from radixserve.router.http_common import error_response

RESPONSE_ID_HEADER = "x-response-id"  # (what radixserve's workers send: server/frontend/responses_api.py)
HOMES_KEPT = 65536


class ResponseHomes:
    def __init__(self, size: int = HOMES_KEPT) -> None:
        self.size = size
        self.homes: OrderedDict[str, str] = OrderedDict()

    def record(self, response_id: str | None, url: str) -> None:
        if not response_id:
            return
        self.homes[response_id] = url
        self.homes.move_to_end(response_id)
        while len(self.homes) > self.size:
            self.homes.popitem(last=False)

    def home(self, response_id: str | None) -> str | None:
        return self.homes.get(response_id) if response_id else None

    def home_of_body(self, raw: bytes, body: object = None) -> str | None:
        """The home of the response a ``/v1/responses`` body continues (its ``previous_response_id``);
        ``body``: the body already parsed, if it was."""
        if b"previous_response_id" not in raw:  # most bodies: no parse
            return None
        if body is None:
            try:
                body = json.loads(raw)
            except (ValueError, RecursionError):
                return None
        prev = body.get("previous_response_id") if isinstance(body, dict) else None
        return self.home(prev) if isinstance(prev, str) else None


async def forward_to_home(request: web.Request, session: aiohttp.ClientSession, home: str | None,
                          urls: list[str], auth: dict[str, str]) -> web.Response:
    """``GET`` / ``DELETE /v1/responses/{id}[/input_items]``: to the response's worker (``home``, when
    it is one of ``urls``); for an id this router did not relay, to each worker in turn until one has it."""
    last: web.Response | None = None
    for url in [home] if home in urls else urls:
        try:
            async with session.request(request.method, url + request.path, params=request.query,
                                       headers=auth) as r:
                last = web.Response(body=await r.read(), status=r.status, content_type="application/json")
        except (aiohttp.ClientError, TimeoutError):
            continue
        if last.status != 404:
            return last
    return last if last is not None else error_response("No healthy worker is available.", 503, "no_healthy_worker")
