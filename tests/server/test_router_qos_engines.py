"""Quality of service across a small real fleet: two CPU workers (the bundled model) behind the
router. The router lets one request run at a time (``--max-concurrent-requests 1``), so the others
wait in its queue and the order it serves them is exact: the priority class first, tenants
interleaved by VTC, and a deadline no worker can meet refused up front (429 + Retry-After)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import httpx
import pytest

from tests.router.router_helpers import Fleet, post
from tests.server.helpers import ServerProcess, assert_memory_ok, wait_idle

BLOCKER = 40  # tokens of the request that holds the router's only slot while the others queue


@pytest.fixture(scope="module")
def workers(shared_server: ServerProcess) -> Iterator[list[str]]:
    second = ServerProcess()
    try:
        second.wait_ready()
        yield [shared_server.url, second.url]
    finally:
        second.kill()


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
