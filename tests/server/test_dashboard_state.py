"""``/dashboard/state`` without a browser: the figures the scheduler collects for it (exact, on the
echo runner), the JSON of a real server and of a router in front of it, and ``--api-key``."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import aiohttp
import httpx
import pytest

from radixserve.server.frontend.http_server import create_app
from radixserve.server.frontend.recent_requests import RecentRequests, percentiles
from radixserve.server.scheduler.dashboard_state import rank_snapshot
from tests.fakes import drain, make_scheduler
from tests.router.router_helpers import run
from tests.sched.policy_helpers import submit
from tests.server.helpers import ServerProcess, fake_dashboard_tm

RANK_KEYS = {"dp_rank", "load", "policy", "scheduler", "policies", "waiting", "running", "kv", "cache", "counters",
             "steps", "spec", "tier"}


def test_step_compositions_prefill_decode_and_mixed() -> None:
    """Each step's (mode, requests, prefill tokens, decode tokens): a MIXED step has both kinds."""
    sched, _, _ = make_scheduler(pool_tokens=512, chunked_prefill_size=32, enable_mixed_chunk=True)
    submit(sched, "a", list(range(1, 11)), 3)
    sched.step()
    submit(sched, "b", list(range(20, 28)), 2)
    drain(sched)
    assert [s[:4] for s in sched.stats.recent_steps] == [("EXTEND", 1, 10, 0), ("MIXED", 2, 8, 1), ("DECODE", 2, 0, 2)]

    unified, _, _ = make_scheduler(pool_tokens=512, scheduler="unified", max_num_batched_tokens=16)
    submit(unified, "a", list(range(1, 11)), 3)
    unified.step()
    submit(unified, "b", list(range(20, 40)), 2)
    drain(unified)
    assert [s[:4] for s in unified.stats.recent_steps] == [
        ("MIXED", 1, 10, 0), ("MIXED", 2, 15, 1), ("MIXED", 2, 5, 1), ("DECODE", 1, 0, 1)]


def test_evictions_are_counted_since_start() -> None:
    sched, _, kv = make_scheduler(pool_tokens=32)
    submit(sched, "a", list(range(1, 21)), 2)
    drain(sched)
    tree = kv.tree_cache
    assert (tree.total_size(), tree.evicted_tokens, tree.evicted_nodes) == (21, 0, 0)
    submit(sched, "b", list(range(100, 120)), 2)  # 20 new tokens, 11 free: a's entry goes
    drain(sched)
    assert (tree.evicted_tokens, tree.evicted_nodes) == (21, 2)
    assert rank_snapshot(sched)["cache"]["evicted_tokens"] == 21
    size = tree.total_size()
    assert sched.flush_cache() and tree.total_size() == 0  # a flush evicts everything: counted too
    assert tree.evicted_tokens == 21 + size


def test_rank_snapshot_groups_requests_by_class_and_matches_get_load() -> None:
    sched, _, _ = make_scheduler(pool_tokens=512, max_reqs=2)
    for i, (prio, tenant) in enumerate([(1, "acme"), (None, "acme"), (1, "beta"), (0, None), (1, "acme")]):
        r = submit(sched, f"r{i}", list(range(10 * i + 1, 10 * i + 7)), 4, priority=prio)
        r.tenant = tenant
    sched.step()  # the first two are admitted (max_reqs=2), three wait
    snap = rank_snapshot(sched)
    assert set(snap) == RANK_KEYS
    assert snap["load"] == {"dp_rank": 0, **sched.get_load()}
    assert snap["running"]["requests"] == 2 and snap["waiting"]["requests"] == 3
    # the most important first (the largest value by default), none last; running: the KV held
    assert snap["running"]["by_priority"] == [[1, 1, 6], [None, 1, 6]]
    assert snap["waiting"]["by_priority"] == [[1, 2, 12], [0, 1, 6]]
    assert snap["waiting"]["by_tenant"] == [["", 1, 6], ["acme", 1, 6], ["beta", 1, 6]]
    load = sched.get_load()
    assert snap["kv"]["used"] == load["num_used_tokens"] == load["num_tokens"] - load["num_waiting_tokens"]
    assert snap["steps"] == [["EXTEND", 2, 12, 0, snap["steps"][0][4]]]
    drain(sched)
    done = rank_snapshot(sched)
    assert done["counters"]["finished"] == 5 and done["running"]["requests"] == done["waiting"]["requests"] == 0


def test_recent_requests_ttft_tpot() -> None:
    rec = RecentRequests(size=2)
    for created, first, n in [(0.0, 1.0, 5), (0.0, 0.5, 1), (0.0, 0.2, 3)]:
        st = SimpleNamespace(created=created, ttft=first)
        last = SimpleNamespace(finished_reason=None, completion_tokens=n, prompt_tokens=7)
        rec.add(st, last, 2.0)  # type: ignore[arg-type]
    s = rec.summary()
    assert s["count"] == 2 and [r[1:] for r in s["recent"]] == [[0.5, None, 7, 1], [0.2, 0.9, 7, 3]]
    assert s["tpot"]["p50"] == 0.9 and s["ttft"]["max"] == 0.5
    assert percentiles([float(i) for i in range(1, 101)]) == {"p50": 50.0, "p90": 90.0, "p99": 99.0, "max": 100.0}


def test_api_key_guards_the_state_not_the_page() -> None:
    async def scenario() -> None:
        app = create_app(fake_dashboard_tm("sk-dash"), "fake-model", {})
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            assert (await c.get("/dashboard/state")).status_code == 401
            assert (await c.get("/dashboard/state", headers={"Authorization": "Bearer wrong"})).status_code == 401
            ok = await c.get("/dashboard/state", headers={"Authorization": "Bearer sk-dash"})
            assert ok.status_code == 200 and ok.json()["ranks"][0]["dp_rank"] == 0
            assert (await c.get("/dashboard/state", headers={"X-API-Key": "sk-dash"})).status_code == 200
            # the page and its files hold no data: public, so a browser can load them and send the key
            page = await c.get("/dashboard")
            assert page.status_code == 200 and "/dashboard/static/dashboard.js" in page.text
            js = await c.get("/dashboard/static/dashboard.js")
            assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
            assert (await c.get("/dashboard/static/../http_server.py")).status_code in (401, 404)
            assert (await c.get("/dashboard/static/nope.js")).status_code == 404
            assert (await c.get("/get_load")).status_code == 401  # the rest stays closed

    asyncio.run(scenario())


@pytest.mark.slow  # a real server
def test_state_of_a_real_server(shared_server: ServerProcess) -> None:
    with shared_server.client() as c:
        state = c.get("/dashboard/state").json()
        load = c.get("/get_load").json()
        info = c.get("/get_server_info").json()
    assert state["kind"] == "server" and state["dp_size"] == 1 and len(state["ranks"]) == 1
    assert state["schedule_policy"] == info["schedule_policy"] and info["schedule_policy"] in state["policies"]
    rank = state["ranks"][0]
    assert set(rank) == RANK_KEYS
    assert rank["kv"]["total"] == info["max_total_num_tokens"]
    # nothing else runs between the two calls: the figures are the same
    assert {k: v for k, v in rank["load"].items() if k != "prefill_tokens_per_s"} == \
           {k: v for k, v in load[0].items() if k != "prefill_tokens_per_s"}
    assert set(state["requests"]) == {"aborted", "count", "ttft", "tpot", "recent"}


@pytest.mark.slow  # a real server
def test_router_state_shows_each_worker(shared_server: ServerProcess) -> None:
    async def scenario(fleet: Any, client: aiohttp.ClientSession) -> None:
        stub = await fleet.stub()  # a stub worker has no dashboard: its column says so
        await fleet.start_router([shared_server.url, stub])
        async with client.get(fleet.url + "/dashboard/state") as r:
            assert r.status == 200
            state = await r.json()
        async with client.get(fleet.url + "/dashboard") as r:
            assert r.status == 200 and "dashboard.js" in await r.text()
        assert state["kind"] == "router" and set(state["router"]) >= {"waiting", "in_flight", "classes"}
        by_url = {w["url"]: w for w in state["workers"]}
        assert by_url[shared_server.url]["state"]["kind"] == "server"
        assert "404" in by_url[stub]["error"]
        assert state["schedule_policy"] == by_url[shared_server.url]["state"]["schedule_policy"]

    run(scenario)
