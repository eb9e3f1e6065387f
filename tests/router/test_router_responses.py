"""The Responses API behind the router: a request that continues a stored response goes to the
worker that stores it (whatever the policy would pick), and reads and deletes of a response reach
it, through the ``x-response-id`` header workers send (stub workers that store like the real one)."""

from __future__ import annotations

import itertools
from typing import Any

import aiohttp
from aiohttp import web

from radixserve.bench.stub_worker import create_stub_app
from tests.router.router_helpers import Fleet, free_port, post, run

_ids = itertools.count()


def _storing_stub(port: int, seen: list[tuple[int, Any]]) -> web.Application:
    """A stub worker with a response store: ``POST /v1/responses`` answers ``resp_N`` (404 for a
    ``previous_response_id`` it does not hold), ``GET`` / ``DELETE`` read and drop it."""
    app = create_stub_app(port)
    store: dict[str, dict[str, Any]] = {}

    async def create(request: web.Request) -> web.Response:
        body = await request.json()
        prev = body.get("previous_response_id")
        seen.append((port, prev))
        if prev is not None and prev not in store:
            return web.json_response({"error": {"message": "not found"}}, status=404)
        rid = f"resp_{next(_ids)}"
        store[rid] = {"id": rid, "object": "response", "worker": port}
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "x-response-id": rid})
            await resp.prepare(request)
            await resp.write(b'data: {"type": "response.completed"}\n\n')
            await resp.write_eof()
            return resp
        return web.json_response(store[rid], headers={"x-response-id": rid})

    async def read(request: web.Request) -> web.Response:
        rid = request.match_info["rid"]
        if rid not in store:
            return web.json_response({"error": {"message": "not found"}}, status=404)
        if request.method == "DELETE":
            del store[rid]
            return web.json_response({"id": rid, "deleted": True})
        if request.path.endswith("/input_items"):
            return web.json_response({"object": "list", "data": [], "limit": request.query.get("limit")})
        return web.json_response(store[rid])

    app.router.add_post("/v1/responses", create)
    app.router.add_get("/v1/responses/{rid}", read)
    app.router.add_get("/v1/responses/{rid}/input_items", read)
    app.router.add_delete("/v1/responses/{rid}", read)
    return app


def test_a_conversation_stays_on_the_worker_that_stores_it() -> None:
    async def scenario(fleet: Fleet, client: aiohttp.ClientSession) -> None:
        seen: list[tuple[int, Any]] = []
        ports = [free_port(), free_port()]
        urls = [await fleet.stub(_storing_stub(p, seen), port=p) for p in ports]
        router = await fleet.start_router(urls, policy="round_robin")
        status, first = await post(client, f"{fleet.url}/v1/responses", {"input": "hi"})
        assert status == 200
        home = first["worker"]
        rid = first["id"]
        # round robin would alternate: every continuation goes home, streamed or not
        for i in range(4):
            body = {"input": f"more {i}", "previous_response_id": rid, "stream": i % 2 == 1}
            async with client.post(f"{fleet.url}/v1/responses", json=body) as r:
                assert r.status == 200
                rid = r.headers["x-response-id"]
                await r.read()
        assert [p for p, prev in seen[1:]] == [home] * 4
        assert router.homes.home(rid) == f"http://127.0.0.1:{home}"
        # plain requests still follow the policy
        await post(client, f"{fleet.url}/v1/responses", {"input": "new"})
        await post(client, f"{fleet.url}/v1/responses", {"input": "new"})
        assert {p for p, _ in seen[5:]} == set(ports)
        # reads and deletes reach the home; an id the router never relayed is looked for everywhere
        async with client.get(f"{fleet.url}/v1/responses/{rid}") as r:
            assert r.status == 200 and (await r.json())["worker"] == home
        async with client.get(f"{fleet.url}/v1/responses/{rid}/input_items", params={"limit": "5"}) as r:
            assert r.status == 200 and (await r.json())["limit"] == "5"
        router.homes.homes.clear()
        async with client.get(f"{fleet.url}/v1/responses/{first['id']}") as r:
            assert r.status == 200 and (await r.json())["worker"] == home
        async with client.delete(f"{fleet.url}/v1/responses/{first['id']}") as r:
            assert r.status == 200
        async with client.get(f"{fleet.url}/v1/responses/{first['id']}") as r:
            assert r.status == 404
        # the home gone: routed as any other request (the worker that gets it says it has no such id)
        await fleet.stop_stub(f"http://127.0.0.1:{home}")
        router.homes.record(rid, f"http://127.0.0.1:{home}")
        router.workers.pop(f"http://127.0.0.1:{home}")
        status, _ = await post(client, f"{fleet.url}/v1/responses", {"input": "x", "previous_response_id": rid})
        assert status == 404 and seen[-1][0] != home

    run(scenario)
