"""A minimal stand-in for a worker: answers the routes the router uses at once, with no model.

    python -m radixserve.bench.stub_worker --port 31001 [--dp-size 2] [--delay-ms 0] [--stream-chunks 4]

For measuring what the router itself costs (``radixserve bench router``) and for the router's
tests. Every answer names the worker (``worker``: its port) and the data-parallel rank it was
asked for, so a test can see where a request landed. ``POST /stub/fail`` with
``{"status": 500, "count": 3}`` makes the next ``count`` generate calls answer ``status``;
``POST /stub/load`` with ``{"num_reqs": 50}`` (or ``num_waiting_tokens``, ``prefill_tokens_per_s``, ``forward_steps``)
sets what its ``/get_load`` reports;
``GET /stub/stats`` returns the requests seen per route.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections import Counter
from typing import Any

from aiohttp import web

# what /get_load reports until POST /stub/load sets it
REPORTED: dict[str, float] = {"num_reqs": 0, "num_waiting_tokens": 0, "prefill_tokens_per_s": 0.0, "forward_steps": 0}


def create_stub_app(port: int, dp_size: int = 1, delay_ms: float = 0.0, stream_chunks: int = 4,
                    disaggregation_mode: str | None = None, bootstrap_port: int | None = None) -> web.Application:
    app = web.Application()
    seen: Counter[str] = Counter()
    fail = {"status": 0, "count": 0}
    ranks: list[int | None] = []
    bodies: list[dict[str, Any]] = []  # the last few request bodies, for tests
    reported: dict[str, float] = dict(REPORTED)

    async def generate(request: web.Request) -> web.StreamResponse:
        seen[request.path] += 1
        body = await request.json()
        bodies.append(body)
        del bodies[:-32]
        rank = body.get("data_parallel_rank")
        ranks.append(rank)
        if rank is not None and not (isinstance(rank, int) and 0 <= rank < dp_size):
            return web.json_response({"error": {"message": f"data_parallel_rank {rank} out of range",
                                                "type": "invalid_request_error", "code": "invalid_value"}},
                                     status=400)
        if fail["count"] > 0:
            fail["count"] -= 1
            return web.json_response({"error": {"message": "stub failure", "type": "server_error",
                                                "code": "stub"}}, status=fail["status"],
                                     headers={"Retry-After": "1"} if fail["status"] == 429 else None)
        if delay_ms:
            await asyncio.sleep(delay_ms / 1e3)
        out = {"text": "ok", "worker": port, "dp_rank": rank, "path": request.path,
               "meta_info": {"finish_reason": {"type": "length"}, "prompt_tokens": 1, "completion_tokens": 1}}
        if not body.get("stream"):
            return web.json_response(out)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        for i in range(stream_chunks):
            await resp.write(f"data: {json.dumps({**out, 'index': i})}\n\n".encode())
            if delay_ms:
                await asyncio.sleep(delay_ms / 1e3)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def ok(request: web.Request) -> web.Response:
        seen[request.path] += 1
        return web.Response(status=200)

    async def server_info(request: web.Request) -> web.Response:
        return web.json_response({"dp_size": dp_size, "model_path": None, "worker": port, "version": "stub",
                                  "disaggregation_mode": disaggregation_mode,
                                  "disaggregation_bootstrap_port": bootstrap_port})

    async def get_load(request: web.Request) -> web.Response:
        return web.json_response([{"dp_rank": r, "num_waiting_reqs": 0, "num_tokens": 0, **reported}
                                  for r in range(dp_size)])

    async def set_load(request: web.Request) -> web.Response:
        reported.update({k: v for k, v in (await request.json()).items() if k in reported})
        return web.json_response({"success": True})

    async def set_fail(request: web.Request) -> web.Response:
        body: dict[str, Any] = await request.json()
        fail["status"], fail["count"] = int(body["status"]), int(body["count"])
        return web.json_response({"success": True})

    async def stats(request: web.Request) -> web.Response:
        return web.json_response({"seen": dict(seen), "ranks": ranks, "bodies": bodies})

    for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
        app.router.add_post(path, generate)
    app.router.add_get("/health", ok)
    app.router.add_route("*", "/flush_cache", ok)
    app.router.add_get("/get_server_info", server_info)
    app.router.add_get("/get_load", get_load)
    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "stub", "object": "model"}]})

    app.router.add_get("/v1/models", models)
    app.router.add_post("/stub/fail", set_fail)
    app.router.add_post("/stub/load", set_load)
    app.router.add_get("/stub/stats", stats)
    return app


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--dp-size", type=int, default=1, help="Data-parallel ranks it reports.")
    p.add_argument("--delay-ms", type=float, default=0.0, help="Delay before answering (and between chunks).")
    p.add_argument("--stream-chunks", type=int, default=4, help="SSE events of a streamed answer.")
    ns = p.parse_args(argv)
    web.run_app(create_stub_app(ns.port, ns.dp_size, ns.delay_ms, ns.stream_chunks), host=ns.host, port=ns.port,
                access_log=None, print=None)


if __name__ == "__main__":
    main()
