"""A server of its own: --api-key and --admin-api-key, a burst far past --max-queued-requests, and
what happens when the scheduler or the detokenizer process dies (/health fails, the server exits
non-zero, nothing hangs, nothing is orphaned)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.server.helpers import API_KEY, ServerProcess, assert_memory_ok, pid_alive, started, wait_idle

pytestmark = pytest.mark.slow  # real servers: the full tier only (scripts/test.sh --fast leaves it out)

ADMIN_KEY = "sk-radixserve-admin"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    yield from started(ServerProcess("--max-queued-requests", "2", "--max-running-requests", "2",
                                     "--admin-api-key", ADMIN_KEY, api_key=API_KEY))


def test_the_http_process_never_loads_torch(server: ServerProcess) -> None:
    """Only the scheduler computes: torch in the HTTP process would cost ~200 MB and a second of
    start-up (the CLI's parser and the children's entry points are what used to pull it in)."""
    with open(f"/proc/{server.proc.pid}/maps") as f:
        maps = f.read()
    assert "libtorch" not in maps
    with open(f"/proc/{server.pids['scheduler']}/maps") as f:
        assert "libtorch" in f.read()  # the check can fail: the scheduler's has it


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


def test_admin_endpoints_need_the_admin_key(server: ServerProcess) -> None:
    """--admin-api-key: the admin endpoints refuse no key, a wrong key and the ordinary --api-key
    (401, OpenAI's shape); the admin key works there and on every other endpoint too."""
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    calls = [("/set_schedule_policy", {"schedule_policy": "fcfs"}), ("/abort_request", {"rid": "nobody"}),
             ("/flush_cache", None)]
    for path, body in calls:
        for headers in ({}, server.headers, {"X-API-Key": API_KEY}, {"Authorization": "Bearer wrong"}):
            r = httpx.post(f"{server.url}{path}", json=body, headers=headers)
            err = r.json()["error"]
            assert r.status_code == 401 and err["code"] == "invalid_api_key", (path, headers, r.text)
            assert err["type"] == "invalid_request_error" and "--admin-api-key" in err["message"]
    assert httpx.get(f"{server.url}/flush_cache", headers=server.headers).status_code == 401  # any method
    r = httpx.post(f"{server.url}/set_schedule_policy", json=calls[0][1], headers=admin)
    assert r.status_code == 200 and r.json()["success"] is True
    assert httpx.post(f"{server.url}/abort_request", json=calls[1][1], headers={"X-API-Key": ADMIN_KEY}).json() == \
        {"success": False, "aborted": []}
    assert httpx.post(f"{server.url}/flush_cache", headers=admin).json()["success"] is True
    assert httpx.get(f"{server.url}/get_load", headers=admin).status_code == 200
    assert httpx.get(f"{server.url}/dashboard/state", headers=admin).status_code == 200
    info = httpx.get(f"{server.url}/get_server_info", headers=server.headers).json()
    assert info["api_key"] == "***" and info["admin_api_key"] == "***"  # never echoed


def _rss_mib(pids: dict[str, int]) -> dict[str, float]:
    out = {}
    for name, pid in pids.items():
        with open(f"/proc/{pid}/status") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        out[name] = kb / 1024
    return out


BURST = 80  # 20x what the server holds: 2 running + 2 queued
RSS_GROWTH_MIB = 64  # the server's processes together, after the burst against before it


def test_burst_of_20x_the_queue(server: ServerProcess) -> None:
    """80 requests at once, through the official client, against 2 running + 2 queued: each one
    either completes with all its tokens (ignore_eos) or is refused with 429 ``queue_full`` and a
    Retry-After; none that was accepted is dropped, none hangs; afterwards the pool is idle (no KV
    or request slot leaked), the server healthy, and its resident memory grew by less than
    ``RSS_GROWTH_MIB``."""
    max_tokens = 6

    async def one(client: openai.AsyncOpenAI, model: str, i: int, stream: bool) -> tuple[str, Any]:
        kw: dict[str, Any] = dict(model=model, prompt=f"Request number {i}:", max_tokens=max_tokens,
                                  extra_body={"ignore_eos": True})
        try:
            if stream:
                chunks = [c async for c in await client.completions.create(
                    stream=True, stream_options={"include_usage": True}, **kw)]
                usage = chunks[-1].usage
                finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            else:
                r = await client.completions.create(**kw)
                usage, finish = r.usage, [r.choices[0].finish_reason]
        except openai.RateLimitError as e:  # anything else fails the test
            return "refused", e
        assert usage is not None
        return "done", (usage.completion_tokens, finish)

    async def burst() -> list[tuple[str, Any]]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
        async with client:
            model = (await client.models.list()).data[0].id
            calls = asyncio.gather(*(one(client, model, i, stream=i % 2 == 0) for i in range(BURST)))
            return await asyncio.wait_for(calls, 90)  # nothing hangs

    rss_before = _rss_mib(server.pids)
    results = asyncio.run(burst())
    kinds = [k for k, _ in results]
    assert kinds.count("refused") > 0 and kinds.count("done") >= 2, kinds
    for kind, got in results:
        if kind == "done":
            assert got == (max_tokens, ["length"])  # accepted: every token, nothing cut short
        else:
            assert got.status_code == 429 and got.code == "queue_full", got.body
            assert int(got.response.headers["retry-after"]) > 0
    with server.client() as c:
        assert c.get("/health").status_code == 200
        assert_memory_ok(wait_idle(c))
        r = c.post("/v1/completions", json={"prompt": "Still alive?", "max_tokens": 2})
        assert r.status_code == 200
    rss_after = _rss_mib(server.pids)
    growth = sum(rss_after.values()) - sum(rss_before.values())
    print(f"burst of {BURST}: {kinds.count('done')} done, {kinds.count('refused')} refused; RSS MiB before "
          f"{ {k: round(v) for k, v in rss_before.items()} } after { {k: round(v) for k, v in rss_after.items()} }")
    assert growth < RSS_GROWTH_MIB, (rss_before, rss_after)


EXIT_WITHIN_S = 15.0  # kill to exit: the server says 503 for a second, then stops (10 s at most)


def _health_fails(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code != 200
    except httpx.HTTPError:
        return True


def _check_child_death(server: ServerProcess, victim: str) -> None:
    """Kill one child process mid-stream: the stream ends with an error event, /health fails from
    then on (the first check after), the server exits non-zero within ``EXIT_WITHIN_S``, and the
    other child does not outlive it."""
    other = "detokenizer" if victim == "scheduler" else "scheduler"
    pid, other_pid = server.pids[victim], server.pids[other]
    with server.client() as c:
        # a request in flight when the process dies gets an error, it does not hang
        with c.stream("POST", "/v1/completions", json={"prompt": "Once", "max_tokens": 1000, "ignore_eos": True,
                                                       "stream": True}) as r:
            lines = r.iter_lines()
            next(ln for ln in lines if ln.startswith("data:"))
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            rest = [ln[5:].strip() for ln in lines if ln.startswith("data:")]
        errors = [json.loads(ln)["error"] for ln in rest if '"error"' in ln]
        assert errors and errors[0]["code"] == "server_unavailable", rest[-3:]
        assert rest[-1] == "[DONE]"
    checks = [_health_fails(server.url)]
    while server.proc.poll() is None and time.monotonic() - killed < EXIT_WITHIN_S + 5:
        checks.append(_health_fails(server.url))
        time.sleep(0.05)
    code = server.proc.wait(timeout=5)
    exited_after = time.monotonic() - killed
    assert all(checks), checks  # never healthy again, from the first check on
    assert code != 0
    assert exited_after < EXIT_WITHIN_S, exited_after
    assert f"the {victim} process died" in server.log_text()
    time.sleep(0.5)
    assert not pid_alive(other_pid), f"the {other} outlived the server"


def test_detokenizer_death_fails_health_and_exits_nonzero(keyed_server: ServerProcess) -> None:
    _check_child_death(keyed_server, "detokenizer")  # (the fixture starts another for whoever comes next)


def test_scheduler_death_fails_health_and_exits_nonzero(server: ServerProcess) -> None:
    _check_child_death(server, "scheduler")  # last: it ends the module's server
