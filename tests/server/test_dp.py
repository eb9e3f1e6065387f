"""Data parallelism: ``radixserve serve --dp-size 2`` (a controller and two scheduler ranks, each with
its own KV pool and radix cache), and the router's ``--dp-aware`` mode in front of it."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator

import httpx
import pytest

from radixserve.server.io_struct import RankLoad
from radixserve.server.scheduler.dp_controller import DPBalancer
from tests.server.helpers import ServerProcess, assert_memory_ok, pid_alive, wait_idle

pytestmark = pytest.mark.slow  # real servers: the full tier only (scripts/test.sh --fast leaves it out)


# --- the balancer --------------------------------------------------------------------------------------
def test_round_robin_balancer() -> None:
    b = DPBalancer("round_robin", 3)
    assert [b.pick(10) for _ in range(5)] == [0, 1, 2, 0, 1]


def test_shortest_queue_counts_what_it_sent_until_the_next_report() -> None:
    b = DPBalancer("shortest_queue", 2)
    assert [b.pick(1) for _ in range(4)] == [0, 1, 0, 1]
    b.report(RankLoad(0, num_reqs=0, num_tokens=0))  # rank 0 finished its two
    assert [b.pick(1) for _ in range(4)] == [0, 0, 0, 1]  # 2 vs 2 is a tie: the lower rank


def test_minimum_tokens_weighs_prompt_lengths() -> None:
    b = DPBalancer("minimum_tokens", 2)
    assert b.pick(1000) == 0 and b.pick(10) == 1 and b.pick(10) == 1 and b.pick(10) == 1
    b.report(RankLoad(1, num_reqs=3, num_tokens=5000))
    assert b.pick(10) == 0
    with pytest.raises(ValueError):
        DPBalancer("fastest", 2)


# --- the server ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dp_server() -> Iterator[ServerProcess]:
    srv = ServerProcess("--dp-size", "2", "--load-balance-method", "round_robin", "--enable-metrics",
                        "--max-total-tokens", "4096")
    try:
        srv.wait_ready()
        yield srv
        code = srv.interrupt()
        assert code == 0, srv.log_text()[-3000:]
        time.sleep(0.5)
        left = [p for name, p in srv.pids.items() if name != "http" and pid_alive(p)]
        assert not left, f"orphan processes after Ctrl-C: {left}"
    finally:
        srv.kill()
        for pid in srv.pids.values():
            if pid_alive(pid):
                os.kill(pid, 9)
        os.unlink(srv.log.name)


def generate(c: httpx.Client, text: str, rank: int | None = None, n: int = 4) -> dict:
    body: dict = {"text": text, "sampling_params": {"max_new_tokens": n, "temperature": 0}}
    if rank is not None:
        body["data_parallel_rank"] = rank
    r = c.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_ranks_have_their_own_cache_and_report_separately(dp_server: ServerProcess) -> None:
    with dp_server.client() as c:
        info = c.get("/get_server_info").json()
        assert info["dp_size"] == 2 and {"dp_controller", "scheduler_0", "scheduler_1"} <= set(info["pids"])
        assert [s["dp_rank"] for s in info["internal_states"]] == [0, 1]
        prompt = "The three primary colours are red, yellow and"
        a = generate(c, prompt, rank=0)
        b = generate(c, prompt, rank=1)
        again = generate(c, prompt, rank=1)
        assert [o["meta_info"]["dp_rank"] for o in (a, b, again)] == [0, 1, 1]
        assert b["meta_info"]["cached_tokens"] == 0  # rank 1 never saw it: its own radix cache
        assert again["meta_info"]["cached_tokens"] > 0
        assert a["output_ids"] == b["output_ids"] == again["output_ids"]  # same model, greedy
        r = c.post("/generate", json={"text": "x", "data_parallel_rank": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "data_parallel_rank"
        r = c.post("/v1/completions", json={"model": "default", "prompt": "x", "max_tokens": 1,
                                            "data_parallel_rank": -1})
        assert r.status_code == 400
        loads = c.get("/get_load").json()
        assert [x["dp_rank"] for x in loads] == [0, 1]
        assert all(x["num_waiting_tokens"] == 0 and x["prefill_tokens_per_s"] > 0 for x in loads)
        mem = wait_idle(c)
        assert_memory_ok(mem)
        assert [m["total"] for m in mem["ranks"]] == [4096, 4096]
        assert c.post("/flush_cache").status_code == 200
        assert all(m["evictable"] == 0 for m in c.get("/debug/memory").json()["ranks"])


def test_round_robin_spreads_and_metrics_carry_the_rank(dp_server: ServerProcess) -> None:
    with dp_server.client() as c:
        ranks = [generate(c, f"Spread {i}:", n=1)["meta_info"]["dp_rank"] for i in range(4)]
        assert sorted(ranks) == [0, 0, 1, 1]
        deadline = time.monotonic() + 10
        while True:
            text = c.get("/metrics").text
            if ('dp_rank="1"' in text and 'dp_rank="0"' in text) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert 'radixserve:num_running_reqs{dp_rank="0"' in text
        assert 'radixserve:generation_tokens_total{dp_rank="1"' in text


def test_dp_aware_router_lands_each_request_on_the_rank_it_chose(dp_server: ServerProcess) -> None:
    """The router (in this process) makes a target per rank and sends data_parallel_rank; the
    worker reports the rank that ran each request."""
    from aiohttp import web

    from radixserve.router.app import create_app
    from radixserve.router.config import RouterArgs
    from radixserve.router.router import Router
    from tests.server.helpers import free_port

    async def scenario() -> None:
        router = Router(RouterArgs(worker_urls=(dp_server.url,), dp_aware=True, policy="round_robin"))
        port = free_port()
        runner = web.AppRunner(create_app(router))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            assert [t.key for t in router.workers[dp_server.url].targets] == [f"{dp_server.url}#dp0",
                                                                              f"{dp_server.url}#dp1"]
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
                for want in (0, 1, 0, 1):
                    r = await c.post("/generate", json={"text": f"Rank {want} please", "sampling_params":
                                                        {"max_new_tokens": 1}})
                    assert r.status_code == 200 and r.json()["meta_info"]["dp_rank"] == want
            assert [t.load for t in router.workers[dp_server.url].targets] == [0, 0]
        finally:
            await runner.cleanup()

    asyncio.run(scenario())
