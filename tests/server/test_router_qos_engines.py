"""Quality of service and failure across a small real fleet: two CPU workers (the bundled model)
behind the router. The router lets one request run at a time (``--max-concurrent-requests 1``), so
the others wait in its queue and the order it serves them is exact: the priority class first,
tenants interleaved by VTC, and a deadline no worker can meet refused up front (429 +
Retry-After). A burst of 20x what the router holds: the excess gets 429 + Retry-After, the rest
completes. Last, one worker is killed with requests in flight: it leaves rotation, the
non-streaming requests it held are served by the other, its started stream ends with an error
event."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import httpx
import pytest

from tests.router.router_helpers import Fleet, post
from tests.server.helpers import ServerProcess, assert_memory_ok, wait_idle

pytestmark = pytest.mark.slow  # real servers: the full tier only (scripts/test.sh --fast leaves it out)

BLOCKER = 40  # tokens of the request that holds the router's only slot while the others queue


@pytest.fixture(scope="module")
def servers(shared_server: ServerProcess) -> Iterator[list[ServerProcess]]:
    """The session's shared server and one of this module's own (the last test kills it)."""
    second = ServerProcess()
    try:
        second.wait_ready()
        yield [shared_server, second]
    finally:
        second.kill()


@pytest.fixture(scope="module")
def workers(servers: list[ServerProcess]) -> list[str]:
    return [s.url for s in servers]


def _body(text: str, max_tokens: int = 2, **extra: Any) -> dict[str, Any]:
    return {"model": "default", "prompt": text, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **extra}


async def _served_in_order(workers: list[str], queued: list[tuple[str, dict[str, Any], dict[str, str]]],
                           **router: Any) -> list[str]:
    """Start a router, occupy its only slot, queue ``queued`` (name, body, headers) behind it and
    return the names in the order their answers came back."""
    fleet = Fleet()
    done: list[str] = []
    try:
        await fleet.start_router(workers, policy="round_robin", max_concurrent_requests=1, queue_size=32, **router)
        async with aiohttp.ClientSession() as client:
            url = f"{fleet.url}/v1/completions"

            async def one(name: str, body: dict[str, Any], headers: dict[str, str]) -> None:
                status, out = await post(client, url, body, headers=headers)
                assert status == 200, out
                done.append(name)

            blocker = asyncio.create_task(one("blocker", _body("Tell me a long story.", BLOCKER), {}))
            while fleet.router is not None and fleet.router.admission.in_flight == 0:
                await asyncio.sleep(0.005)
            tasks = []
            for name, body, headers in queued:  # each one waits in the router's queue before the next
                tasks.append(asyncio.create_task(one(name, body, headers)))
                n = len(tasks)
                while fleet.router.admission.waiting < n:
                    await asyncio.sleep(0.002)
            await asyncio.gather(blocker, *tasks)
    finally:
        await fleet.close()
    return done


def test_priority_class_first(workers: list[str]) -> None:
    queued = [(f"low{i}", _body(f"Low {i}", priority=0), {}) for i in range(3)]
    queued.append(("high", _body("High", priority=10), {}))
    order = asyncio.run(_served_in_order(workers, queued, enable_priority_scheduling=True))
    assert order == ["blocker", "high", "low0", "low1", "low2"]
    fifo = asyncio.run(_served_in_order(workers, queued))
    assert fifo == ["blocker", "low0", "low1", "low2", "high"]


def test_tenants_interleaved_by_vtc(workers: list[str]) -> None:
    # equal bodies: equal costs, so the order follows the counters exactly
    queued = [(f"a{i}", _body("Same size"), {"x-tenant": "a"}) for i in range(4)]
    queued += [(f"b{i}", _body("Same size"), {"x-tenant": "b"}) for i in range(2)]
    order = asyncio.run(_served_in_order(workers, queued, tenant_fairness=True))
    # b joins at a's waiting counter, then the tenant served less goes first (ties: arrival)
    assert order == ["blocker", "a0", "b0", "a1", "b1", "a2", "a3"]


def test_unmeetable_deadline_refused_up_front(workers: list[str]) -> None:
    async def scenario() -> tuple[int, str | None, int, float]:
        fleet = Fleet()
        try:
            await fleet.start_router(workers, policy="deadline_aware")
            await asyncio.sleep(1.5)  # the router reads each worker's /get_load once a second
            async with aiohttp.ClientSession() as client:
                url = f"{fleet.url}/v1/completions"
                t0 = time.perf_counter()
                async with client.post(url, json=_body("Hi"), headers={"x-ttft-slo-ms": "0.01"}) as r:
                    refused, retry = r.status, r.headers.get("Retry-After")
                    code = (await r.json())["error"]["code"]
                refused_ms = (time.perf_counter() - t0) * 1e3
                status, out = await post(client, url, _body("Hi"), headers={"x-ttft-slo-ms": "60000"})
                assert status == 200, out
                assert code == "deadline_unmeetable"
                return refused, retry, status, refused_ms
        finally:
            await fleet.close()

    refused, retry, ok, refused_ms = asyncio.run(scenario())
    assert refused == 429 and retry is not None and ok == 200
    assert refused_ms < 1000  # answered by the router at once, no worker involved


def test_workers_idle_after(workers: list[str]) -> None:
    for url in workers:
        with httpx.Client(base_url=url, timeout=30) as c:
            assert_memory_ok(wait_idle(c))


BURST = 80  # 20x what the router holds: 2 in flight + 2 in its queue


def test_router_burst_of_20x_its_queue(workers: list[str]) -> None:
    """Every request the router lets in completes with all its tokens; the excess is refused at
    once with 429 ``rate_limit_exceeded`` and a Retry-After; the router's counts and the workers'
    pools are back at idle after."""
    async def scenario() -> list[tuple[int, Any, str | None]]:
        fleet = Fleet()
        try:
            router = await fleet.start_router(workers, policy="round_robin", max_concurrent_requests=2,
                                              queue_size=2)
            async with aiohttp.ClientSession() as client:
                async def one(i: int) -> tuple[int, Any, str | None]:
                    async with client.post(f"{fleet.url}/v1/completions", json=_body(f"Burst {i}:", 6)) as r:
                        return r.status, await r.json(), r.headers.get("Retry-After")

                results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(BURST))), 90)
            assert fleet.loads() == [0, 0] and router.admission.in_flight == 0 and router.admission.waiting == 0
            return results
        finally:
            await fleet.close()

    results = asyncio.run(scenario())
    done = [out for status, out, _ in results if status == 200]
    refused = [(out, retry) for status, out, retry in results if status != 200]
    assert len(done) >= 4 and refused, [s for s, _, _ in results]
    assert all(out["usage"]["completion_tokens"] == 6 and out["choices"][0]["finish_reason"] == "length"
               for out in done)
    for out, retry in refused:
        assert out["error"]["code"] == "rate_limit_exceeded" and retry is not None and int(retry) > 0, out
    for url in workers:
        with httpx.Client(base_url=url, timeout=30) as c:
            assert_memory_ok(wait_idle(c))


STREAM_TOKENS = 64  # long enough to be mid-stream when the worker dies
PLAIN_TOKENS = 32


def test_a_worker_killed_mid_flight_loses_no_accepted_request(servers: list[ServerProcess]) -> None:
    """Two streams (one per worker, round robin) and eight non-streaming requests in flight; then
    every process of the second worker is killed. With the default health settings (a check a
    minute, three failures to eject), the dead worker leaves rotation at once (its port refuses);
    every non-streaming request answers 200 with all its tokens (those on the dead worker retried
    on the live one); the live worker's stream completes; the dead worker's stream ends with a
    ``worker_failed`` error event and [DONE]. The live worker is idle after, its pool intact. This
    test ends the module's second worker: it runs last."""
    live, victim = servers
    plain = _body("Count slowly:", PLAIN_TOKENS)

    async def scenario() -> tuple[list[list[bytes]], list[tuple[int, Any]], bool, str]:
        fleet = Fleet()
        try:
            router = await fleet.start_router([live.url, victim.url], policy="round_robin")
            async with aiohttp.ClientSession() as client:
                url = f"{fleet.url}/v1/completions"
                started = [asyncio.Event(), asyncio.Event()]

                async def stream(i: int) -> list[bytes]:
                    body = {**_body(f"Tell story {i}:", STREAM_TOKENS), "stream": True}
                    async with client.post(url, json=body) as r:
                        assert r.status == 200
                        events = []
                        async for line in r.content:
                            if line.startswith(b"data:"):
                                events.append(line[5:].strip())
                                started[i].set()
                        return events

                streams = []
                for i in range(2):  # in turn: one to each worker
                    streams.append(asyncio.create_task(stream(i)))
                    await asyncio.wait_for(started[i].wait(), 60)
                plains = [asyncio.create_task(post(client, url, plain)) for _ in range(8)]
                deadline = time.monotonic() + 30
                while router.workers[victim.url].load < 3:  # its stream and two plain requests at least
                    assert time.monotonic() < deadline, fleet.loads()
                    await asyncio.sleep(0.005)
                for pid in victim.pids.values():
                    os.kill(pid, signal.SIGKILL)
                results = await asyncio.wait_for(asyncio.gather(*plains), 60)
                events = await asyncio.wait_for(asyncio.gather(*streams), 60)
                healthy = router.workers[victim.url].health.healthy
                metrics = await (await client.get(f"{fleet.url}/metrics")).text()
            assert fleet.loads() == [0, 0]
            return events, results, healthy, metrics
        finally:
            await fleet.close()

    events, results, victim_healthy, metrics = asyncio.run(scenario())
    assert not victim_healthy  # ejected at once, without waiting for three checks a minute apart
    assert [status for status, _ in results] == [200] * 8, results
    assert all(out["usage"]["completion_tokens"] == PLAIN_TOKENS for _, out in results)
    assert 'radixserve_router_retries_total{reason="connection_error"}' in metrics
    cut, completed = sorted(events, key=lambda ev: not any(b'"error"' in e for e in ev))
    assert completed[-1] == b"[DONE]" and not any(b'"error"' in e for e in completed)
    finish = [c["finish_reason"] for e in completed[:-1] for c in json.loads(e)["choices"] if c["finish_reason"]]
    assert finish == ["length"]  # the live worker's stream: to its last token
    assert cut[-1] == b"[DONE]" and json.loads(cut[-2])["error"]["code"] == "worker_failed", cut[-3:]
    assert all(json.loads(e).get("choices") for e in cut[:-2])  # whole events before it, none cut in half
    assert "radixserve_router_stream_failures_total 1.0" in metrics
    assert victim.proc.wait(10) != 0
    with httpx.Client(base_url=live.url, timeout=30) as c:
        assert_memory_ok(wait_idle(c))
