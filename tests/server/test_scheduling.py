"""Scheduling over HTTP: live policy switching, TTFT deadlines (x-ttft-slo-ms, ttft_slo_ms,
deadline_ms), TPOT deadlines (x-slo-tpot-ms, tpot_slo_ms), tenants (x-tenant, user) and the per-class metrics."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.server.helpers import ServerProcess, assert_memory_ok, wait_idle

pytestmark = pytest.mark.slow  # real servers: the full tier only (scripts/test.sh --fast leaves it out)

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
    info = c.get("/get_server_info").json()  # the server's own report follows the switch
    assert info["schedule_policy"] == "lpm" and info["priority_aging_horizon"] == 2.0
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
    # TPOT deadlines: header or body field; a microsecond per token cannot be met once the server
    # has measured a decode step (the chats above decoded)
    assert _chat(c, {"x-slo-tpot-ms": "60000"}).status_code == 200
    assert c.post("/generate", json={"text": "Hi", "tpot_slo_ms": 60000,
                                     "sampling_params": {"max_new_tokens": 3}}).status_code == 200
    for r in (_chat(c, {"x-slo-tpot-ms": "0.001"}), _chat(c, tpot_slo_ms=0.001)):
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "tpot_unmeetable"
    for r in (_chat(c, {"x-slo-tpot-ms": "fast"}), _chat(c, tpot_slo_ms=0)):
        assert r.status_code == 400
        assert "tpot" in r.json()["error"]["param"]
    metrics = c.get("/metrics").text
    assert 'radixserve:time_to_first_token_by_class_seconds_bucket' in metrics
    assert 'tenant="t1"' in metrics and 'tenant="t2"' in metrics
    assert "radixserve:queue_time_by_class_seconds_count" in metrics
    assert_memory_ok(wait_idle(c))


# --- per-class counters, end to end without a server: scheduler -> SchedulerStats -> /metrics --------
def test_preemption_retraction_and_starvation_counters_by_class() -> None:
    """Unit test (no server process): a scheduler over the fake runner preempts, retracts and
    starves requests of known classes; ``SchedulerServer.stats`` (the message the scheduler process
    sends) carries the totals per class and ``ServerMetrics`` renders them labelled."""
    from types import SimpleNamespace

    from prometheus_client.parser import text_string_to_metric_families

    from radixserve.server.frontend.metrics import ServerMetrics
    from radixserve.server.scheduler.scheduler_proc import SchedulerServer
    from tests.fakes import drain, make_scheduler
    from tests.sched.policy_helpers import prompt, submit

    sched, _, kv = make_scheduler(
        pool_tokens=128, max_running_requests=2, enable_priority_scheduling=True,
        priority_scheduling_preemption_threshold=0, starvation_threshold=5.0, retract_decode_steps=1)
    now = [0.0]
    sched.clock.source = lambda: now[0]
    a = submit(sched, "a", prompt(41, 6), 30, priority=0)
    b = submit(sched, "b", prompt(42, 6), 30, priority=0)
    a.tenant = b.tenant = "t1"
    sched.step()
    sched.step()
    c = submit(sched, "c", prompt(43, 6), 30, priority=10)
    c.tenant = "t2"
    now[0] = 10.0  # c waits 10 s > --starvation-threshold 5 s
    sched.step()  # c takes b's slot: b preempted, c first scheduled (starved)
    assert b.num_preemptions == 1 and sched.queues.running.reqs == [a] and sched.cur_batch.reqs == [c]
    sched.step()
    kv.tree_cache.evict(kv.tree_cache.evictable_size())
    hog = kv.allocator.alloc(kv.available_size())
    sched.step()  # no KV for the next decode: c (fewest outputs) is retracted
    assert c.num_retractions == 1 and a.num_retractions == 0
    kv.allocator.free(hog)
    drain(sched)

    stats = SchedulerServer.stats(SimpleNamespace(sched=sched, _gen_throughput=0.0, dp_rank=0))  # type: ignore[arg-type]
    assert stats.by_class == [("0", "t1", 1, 0, 0), ("10", "t2", 0, 1, 1)]
    assert (stats.num_preemptions, stats.num_retractions, stats.num_starved) == (1, 1, 1)
    metrics = ServerMetrics("m")
    metrics.on_scheduler_stats(stats)
    metrics.on_scheduler_stats(stats)  # cumulative totals: a repeat adds nothing
    got = {
        (s.name, s.labels.get("priority"), s.labels.get("tenant")): s.value
        for fam in text_string_to_metric_families(metrics.render().decode())
        for s in fam.samples if s.name.endswith("_by_class_total")
    }
    assert got == {
        ("radixserve:num_preempted_reqs_by_class_total", "0", "t1"): 1.0,
        ("radixserve:num_retracted_reqs_by_class_total", "10", "t2"): 1.0,
        ("radixserve:num_starved_reqs_by_class_total", "10", "t2"): 1.0,
    }
