"""The router's data plane, in one event loop with stub workers (no model): load counting through
errors and disconnects, retries, backpressure, DP-aware ranks, auth, token matching, 404s."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from tests.router.router_helpers import Fleet, free_port, post, run


def test_routes_streams_and_counts_load_back_to_zero() -> None:
    async def scenario(fleet: Fleet, client: aiohttp.ClientSession) -> None:
        a, b = await fleet.stub(), await fleet.stub()
        await fleet.start_router([a, b], policy="round_robin")
        ports = []
        for i in range(4):
            status, out = await post(client, f"{fleet.url}/generate", {"text": f"q{i}"})
            assert status == 200
            ports.append(out["worker"])
        assert ports[0] != ports[1] and ports[:2] == ports[2:]
        async with client.post(f"{fleet.url}/v1/chat/completions",
                               json={"messages": [{"role": "user", "content": "hi"}], "stream": True}) as r:
            assert r.headers["Content-Type"].startswith("text/event-stream")
            events = [line async for line in r.content if line.startswith(b"data:")]
        assert len(events) == 5 and events[-1].strip() == b"data: [DONE]"
        assert fleet.loads() == [0, 0]

    run(scenario)


def test_retry_after_connection_error_5xx_and_429_goes_elsewhere() -> None:
    async def scenario(fleet: Fleet, client: aiohttp.ClientSession) -> None:
        good, bad = await fleet.stub(), await fleet.stub()
        dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
        router = await fleet.start_router([dead, bad, good], policy="round_robin", cb_failure_threshold=0)
        router.workers[dead].health.healthy = True  # pretend it passed its checks before dying
        await post(client, f"{bad}/stub/fail", {"status": 500, "count": 100})
        for _ in range(6):
            status, out = await post(client, f"{fleet.url}/generate", {"text": "x"})
            assert status == 200 and out["worker"] == int(good.rsplit(":", 1)[1])
        await post(client, f"{bad}/stub/fail", {"status": 429, "count": 100})
        status, out = await post(client, f"{fleet.url}/generate", {"text": "x"})
        assert status == 200
        assert fleet.loads() == [0, 0, 0]
        metrics = await (await client.get(f"{fleet.url}/metrics")).text()
        assert 'radixserve_router_retries_total{reason="connection_error"}' in metrics
        assert 'radixserve_router_retries_total{reason="status_5xx"}' in metrics
        assert 'radixserve_router_retries_total{reason="status_429"}' in metrics

    run(scenario)


def test_out_of_retries_passes_the_workers_answer_through() -> None:
    async def scenario(fleet: Fleet, client: aiohttp.ClientSession) -> None:
        w = await fleet.stub()
        await fleet.start_router([w], retry_max_retries=2)
        await post(client, f"{w}/stub/fail", {"status": 429, "count": 3})
        async with client.post(f"{fleet.url}/generate", json={"text": "x"}) as r:
            assert r.status == 429 and r.headers["Retry-After"] == "1"
        stats = await (await client.get(f"{w}/stub/stats")).json()
        assert stats["seen"]["/generate"] == 3  # the first try and two retries
        assert fleet.loads() == [0]

    run(scenario)


def test_no_retry_once_streaming_started_and_the_stream_ends_with_an_error_event() -> None:
    """A worker that dies mid-stream, in the middle of an event: the client gets the whole events
    before it, never the half one, then an error event in OpenAI's shape and [DONE]; no retry (the
    client had bytes already), and the load count goes back to zero."""
    calls = {"n": 0}

    async def breaks_mid_stream(request: web.Request) -> web.StreamResponse:
        calls["n"] += 1
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"text": "whole"}\n\ndata: {"text": "ha')
        await asyncio.sleep(0.05)
        assert request.transport is not None
        request.transport.close()  # the worker dies mid-stream
        return resp

    async def info(request: web.Request) -> web.Response:
        return web.json_response({"dp_size": 1})

    async def scenario(fleet: Fleet, client: aiohttp.ClientSession) -> None:
        app = web.Application()
        app.router.add_post("/generate", breaks_mid_stream)
        app.router.add_get("/get_server_info", info)
        w, other = await fleet.stub(app), await fleet.stub()
        await fleet.start_router([w, other], policy="round_robin")
        async with client.post(f"{fleet.url}/generate", json={"text": "x", "stream": True}) as r:
            assert r.status == 200
            events = [e for e in (await r.content.read()).split(b"\n\n") if e]
        assert calls["n"] == 1  # not retried: the client had its first bytes already
        assert events[0] == b'data: {"text": "whole"}' and events[-1] == b"data: [DONE]" and len(events) == 3
        err = json.loads(events[1][len(b"data: "):])["error"]
        assert err["code"] == "worker_failed" and err["type"] == "server_error"
        await asyncio.sleep(0.05)
        assert fleet.loads() == [0, 0]
        metrics = await (await client.get(f"{fleet.url}/metrics")).text()
        assert "radixserve_router_stream_failures_total 1.0" in metrics

    run(scenario)


def test_client_disconnect_mid_stream_releases_the_load() -> None:
    async def scenario(fleet: Fleet, client: aiohttp.ClientSession) -> None:
        w = await fleet.stub(delay_ms=200, stream_chunks=50)
        await fleet.start_router([w])
        async with client.post(f"{fleet.url}/generate", json={"text": "x", "stream": True}) as r:
            await r.content.readline()
            assert fleet.loads() == [1]
        # leaving the block closed the connection mid-stream
        for _ in range(100):
            if fleet.loads() == [0]:
                break
            await asyncio.sleep(0.02)
        assert fleet.loads() == [0]

    run(scenario)


def test_backpressure_queue_then_429() -> None:
    async def scenario(fleet: Fleet, client: aiohttp.ClientSession) -> None:
        w = await fleet.stub(delay_ms=300)
        await fleet.start_router([w], max_concurrent_requests=1, queue_size=1, queue_timeout_secs=5.0)
        tasks = [asyncio.create_task(post(client, f"{fleet.url}/generate", {"text": str(i)})) for i in range(2)]
        await asyncio.sleep(0.1)
        async with client.post(f"{fleet.url}/generate", json={"text": "third"}) as r:
            body = await r.json()
            assert r.status == 429 and r.headers["Retry-After"] == "1"
            assert body["error"]["code"] == "rate_limit_exceeded"
        assert [s for s, _ in await asyncio.gather(*tasks)] == [200, 200]  # the queued one was served
        assert fleet.loads() == [0]

    run(scenario)


def test_dp_aware_sends_the_chosen_rank() -> None:
    async def scenario(fleet: Fleet, client: aiohttp.ClientSession) -> None:
        w = await fleet.stub(dp_size=2)
        one = await fleet.stub(dp_size=1)
        router = await fleet.start_router([w, one], policy="round_robin", dp_aware=True)
        assert [t.key for t in router.workers[w].targets] == [f"{w}#dp0", f"{w}#dp1"]
        seen = [(await post(client, f"{fleet.url}/generate", {"text": "x"}))[1] for _ in range(6)]
        assert [(o["worker"], o["dp_rank"]) for o in seen[:3]] == [
            (int(w.rsplit(":", 1)[1]), 0), (int(w.rsplit(":", 1)[1]), 1), (int(one.rsplit(":", 1)[1]), 0)]
        assert fleet.loads() == [0, 0, 0]

    run(scenario)


def test_api_key_and_malformed_json() -> None:
    async def scenario(fleet: Fleet, client: aiohttp.ClientSession) -> None:
        w = await fleet.stub()
        await fleet.start_router([w], api_key="secret")
        async with client.get(f"{fleet.url}/health") as r:
            assert r.status == 200
        status, out = await post(client, f"{fleet.url}/generate", {"text": "x"})
        assert status == 401 and out["error"]["code"] == "invalid_api_key"
        auth = {"Authorization": "Bearer secret"}
        assert (await post(client, f"{fleet.url}/generate", {"text": "x"}, headers=auth))[0] == 200
        async with client.post(f"{fleet.url}/generate", data=b"[" * 5000, headers=auth) as r:
            assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_json"
        async with client.get(f"{fleet.url}/metrics", headers=auth) as r:
            text = await r.text()
        assert 'radixserve_router_decisions_total{branch="cache_miss",policy="cache_aware"} 1.0' in text
        assert "radixserve_router_in_flight_requests" in text and "radixserve_router_worker_healthy" in text

    run(scenario)


def test_power_of_two_reads_the_workers_reported_load() -> None:
    async def scenario(fleet: Fleet, client: aiohttp.ClientSession) -> None:
        busy, idle = await fleet.stub(), await fleet.stub()
        await post(client, f"{busy}/stub/load", {"num_reqs": 50})  # traffic the router never saw
        router = await fleet.start_router([busy, idle], policy="power_of_two", seed=1)
        for _ in range(100):
            if router.workers[busy].targets[0].reported_load == 50:
                break
            await asyncio.sleep(0.05)
        ports = {(await post(client, f"{fleet.url}/generate", {"text": "x"}))[1]["worker"] for _ in range(8)}
        assert ports == {int(idle.rsplit(":", 1)[1])}

    run(scenario)


def test_token_matching_uses_the_models_tokenizer() -> None:
    async def scenario(fleet: Fleet, client: aiohttp.ClientSession) -> None:
        a, b = await fleet.stub(), await fleet.stub()
        router = await fleet.start_router([a, b], prefix_match="tokens")
        tok = router.tokenizer
        assert tok is not None  # the stub names no model: the bundled one
        messages = [{"role": "system", "content": "You are terse. " * 20}, {"role": "user", "content": "Hi"}]
        assert list(router.route_request("/v1/chat/completions", {"messages": messages}).key) == \
            tok.encode_chat(messages)
        assert list(router.route_request("/generate", {"text": "Hello there"}).key) == tok.encode("Hello there")
        assert list(router.route_request("/v1/completions", {"prompt": [[5, 6, 7]]}).key) == [5, 6, 7]
        workers = set()
        for q in ("Hi", "What now?", "Why?"):
            body = {"messages": [messages[0], {"role": "user", "content": q}]}
            workers.add((await post(client, f"{fleet.url}/v1/chat/completions", body))[1]["worker"])
        assert len(workers) == 1  # the shared system prompt keeps them together

    run(scenario)


def test_unknown_route_is_an_openai_shaped_404() -> None:
    async def scenario(fleet: Fleet, client: aiohttp.ClientSession) -> None:
        await fleet.start_router([await fleet.stub()])
        async with client.get(f"{fleet.url}/nope") as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "not_found"
        async with client.get(f"{fleet.url}/generate") as r:
            assert r.status == 405 and (await r.json())["error"]["code"] == "method_not_allowed"

    run(scenario)
