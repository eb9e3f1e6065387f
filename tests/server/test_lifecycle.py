"""A server of its own: --api-key, --max-queued-requests, and what happens when the scheduler
process dies (/health fails, the server exits non-zero, nothing hangs, nothing is orphaned)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.server.helpers import API_KEY, ServerProcess, assert_memory_ok, pid_alive, wait_idle


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    srv = ServerProcess("--max-queued-requests", "2", "--max-running-requests", "2", api_key=API_KEY)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.kill()
        os.unlink(srv.log.name)


def test_api_key(server: ServerProcess) -> None:
    assert httpx.get(f"{server.url}/health").status_code == 200  # /health is open
    for path in ("/get_load", "/v1/models", "/get_server_info", "/metrics"):
        r = httpx.get(f"{server.url}{path}")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
    r = httpx.get(f"{server.url}/get_load", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    ok = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    r2 = ok.completions.create(model=ok.models.list().data[0].id, prompt="Hi", max_tokens=2)
    assert r2.usage is not None and r2.usage.completion_tokens <= 2


def test_set_schedule_policy_needs_api_key(server: ServerProcess) -> None:
    body = {"schedule_policy": "fcfs"}
    r = httpx.post(f"{server.url}/set_schedule_policy", json=body)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(f"{server.url}/set_schedule_policy", json=body, headers=server.headers)
    assert r.status_code == 200 and r.json()["success"] is True


def test_max_queued_requests(server: ServerProcess) -> None:
    """20 requests at once against 2 running + 2 queued: each completes or gets 429 with
    Retry-After; none that was accepted is dropped; the server stays healthy."""

    async def one(client: httpx.AsyncClient, i: int, stream: bool) -> tuple[int, str | None, int]:
        body = {"prompt": f"Request number {i}:", "max_tokens": 6, "ignore_eos": True, "stream": stream}
        if not stream:
            r = await client.post("/v1/completions", json=body)
            n = r.json()["usage"]["completion_tokens"] if r.status_code == 200 else 0
            return r.status_code, r.headers.get("retry-after"), n
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return r.status_code, r.headers.get("retry-after"), 0
            n = len([ln async for ln in r.aiter_lines() if ln.startswith("data:") and "[DONE]" not in ln])
            return 200, None, n

    async def burst() -> list[tuple[int, str | None, int]]:
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=120) as client:
            return await asyncio.gather(*(one(client, i, stream=i % 2 == 0) for i in range(20)))

    results = asyncio.run(burst())
    codes = [r[0] for r in results]
    assert set(codes) <= {200, 429}, codes
    assert codes.count(429) > 0 and codes.count(200) >= 2
    for code, retry_after, n in results:
        if code == 429:
            assert retry_after is not None
        else:
            assert n > 0
    with server.client() as c:
        assert c.get("/health").status_code == 200
        assert_memory_ok(wait_idle(c))
        r = c.post("/v1/completions", json={"prompt": "Still alive?", "max_tokens": 2})
        assert r.status_code == 200


def test_scheduler_death_fails_health_and_exits_nonzero(server: ServerProcess) -> None:
    sched, detok = server.pids["scheduler"], server.pids["detokenizer"]
    with server.client() as c:
        # a request in flight when the scheduler dies gets an error, it does not hang
        with c.stream("POST", "/v1/completions", json={"prompt": "Once", "max_tokens": 1000, "ignore_eos": True,
                                                       "stream": True}) as r:
            lines = r.iter_lines()
            next(ln for ln in lines if ln.startswith("data:"))
            os.kill(sched, signal.SIGKILL)
            rest = [ln for ln in lines if ln.startswith("data:")]
        assert any('"error"' in ln for ln in rest), rest[-3:]
    health_failed = False
    deadline = time.monotonic() + 30
    while server.proc.poll() is None and time.monotonic() < deadline:
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code != 200:
                health_failed = True
        except httpx.HTTPError:
            health_failed = True
        time.sleep(0.05)
    code = server.proc.wait(timeout=5)
    assert health_failed
    assert code != 0
    time.sleep(0.5)
    assert not pid_alive(detok), "the detokenizer outlived the server"

