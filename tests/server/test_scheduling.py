"""Issue-#5 scheduling over HTTP: live policy switching, TTFT deadlines (x-ttft-slo-ms, ttft_slo_ms,
deadline_ms), tenants (x-tenant, user) and the per-class metrics."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.server.helpers import ServerProcess, assert_memory_ok, wait_idle

CHAT = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 3}


@pytest.fixture
def c(shared_server: ServerProcess) -> Iterator[httpx.Client]:
    with shared_server.client() as client:
        yield client
        # the server is shared: back to its defaults
        r = client.post("/set_schedule_policy", json={"schedule_policy": "fcfs", "deadline_admission": False})
        assert r.status_code == 200, r.text


def test_set_schedule_policy_live(c: httpx.Client) -> None:
    r = c.post("/set_schedule_policy", json={"schedule_policy": "lpm", "priority_aging_horizon": 2.0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["success"] is True and body["schedule_policy"] == "lpm"
    assert body["params"]["priority_aging_horizon"] == 2.0
    out = c.post("/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 2}})
    assert out.status_code == 200
    for bad in ({"schedule_policy": "nope"}, {"priority_aging_horizon": -1}, {}):
        r = c.post("/set_schedule_policy", json=bad)
        assert r.status_code == 400, bad
        assert r.json()["error"]["code"] in ("invalid_schedule_policy", "invalid_json")
    r = c.post("/set_schedule_policy", json={"schedule_policy": "vtc", "tenant_weights": "t1=2"})
    assert r.status_code == 200 and r.json()["success"]
    assert_memory_ok(wait_idle(c))


def _chat(c: httpx.Client, headers: dict[str, str] | None = None, **extra: Any) -> httpx.Response:
    return c.post("/v1/chat/completions", json={**CHAT, **extra}, headers=headers or {})


def test_deadlines_and_tenants(c: httpx.Client) -> None:
    r = c.post("/set_schedule_policy", json={"schedule_policy": "edf", "deadline_admission": True})
    assert r.status_code == 200, r.text
    # generous deadlines and tenants from the header and from the user field
    assert _chat(c, {"x-ttft-slo-ms": "60000", "x-tenant": "t1"}).status_code == 200
    assert _chat(c, ttft_slo_ms=60000, user="t2").status_code == 200
    ok = c.post("/generate", json={"text": "Hi", "deadline_ms": 60000, "sampling_params": {"max_new_tokens": 2}},
                headers={"x-tenant": "t1"})
    assert ok.status_code == 200
    # a microsecond to the first token cannot be met: refused at arrival
    for r in (_chat(c, {"x-ttft-slo-ms": "0.001"}), _chat(c, ttft_slo_ms=0.001),
              c.post("/generate", json={"text": "Hi", "deadline_ms": 0.001, "sampling_params": {"max_new_tokens": 2}})):
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "deadline_unmeetable"
    for r in (_chat(c, {"x-ttft-slo-ms": "soon"}), _chat(c, ttft_slo_ms=-5)):
        assert r.status_code == 400
    metrics = c.get("/metrics").text
    assert 'radixserve:time_to_first_token_by_class_seconds_bucket' in metrics
    assert 'tenant="t1"' in metrics and 'tenant="t2"' in metrics
    assert "radixserve:queue_time_by_class_seconds_count" in metrics
    assert_memory_ok(wait_idle(c))
