"""Quality of service at the router, against stub workers: deadline-aware routing (and refusal)
from the workers' reported queue and prefill speed, priority and tenant order in the router's queue."""

from __future__ import annotations

import asyncio

import aiohttp

from tests.router.router_helpers import Fleet, post, run


def test_deadline_aware_routes_by_reported_queue_and_refuses_up_front() -> None:
    async def scenario(fleet: Fleet, client: aiohttp.ClientSession) -> None:
        busy, idle = await fleet.stub(), await fleet.stub()
        await post(client, f"{busy}/stub/load", {"num_waiting_tokens": 50_000, "prefill_tokens_per_s": 1000.0})
        await post(client, f"{idle}/stub/load", {"num_waiting_tokens": 500, "prefill_tokens_per_s": 1000.0})
        router = await fleet.start_router([busy, idle], policy="deadline_aware")
        for _ in range(100):  # the first load report
            if router.workers[busy].targets[0].prefill_tokens_per_s > 0:
                break
            await asyncio.sleep(0.05)
        body = {"text": "word " * 400, "sampling_params": {"max_new_tokens": 1}}
        status, out = await post(client, f"{fleet.url}/generate", body, headers={"x-ttft-slo-ms": "2000"})
        assert status == 200 and out["worker"] == int(idle.rsplit(":", 1)[1])  # 0.5 s + 0.1 s vs 50 s
        async with client.post(f"{fleet.url}/generate", json={**body, "deadline_ms": 100}) as r:
            err = await r.json()
            assert r.status == 429 and r.headers["Retry-After"] == "1"
            assert err["error"]["code"] == "deadline_unmeetable"
        status, _ = await post(client, f"{fleet.url}/v1/completions", {"prompt": "hi", "ttft_slo_ms": 60000})
        assert status == 200
        metrics = await (await client.get(f"{fleet.url}/metrics")).text()
        assert 'radixserve_router_rejected_total{reason="deadline"} 1.0' in metrics
        assert fleet.loads() == [0, 0]

    run(scenario)


def test_router_queue_lets_the_important_and_the_fair_through_first() -> None:
    async def scenario(fleet: Fleet, client: aiohttp.ClientSession) -> None:
        w = await fleet.stub(delay_ms=150)
        await fleet.start_router([w], max_concurrent_requests=1, queue_size=10, enable_priority_scheduling=True,
                                 tenant_fairness=True)
        first = asyncio.create_task(post(client, f"{fleet.url}/generate", {"text": "holder", "priority": 0}))
        await asyncio.sleep(0.05)
        queued = []
        for name, priority, tenant in (("a1", 0, "a"), ("a2", 0, "a"), ("b1", 0, "b"), ("vip", 9, "a"),
                                       ("none", None, "c")):
            body = {"text": name, "tenant": tenant, **({"priority": priority} if priority is not None else {})}
            queued.append(asyncio.create_task(post(client, f"{fleet.url}/generate", body)))
            await asyncio.sleep(0.02)
        await asyncio.gather(first, *queued)
        stats = await (await client.get(f"{w}/stub/stats")).json()
        # the most important first; it was tenant a's, so among priority 0 tenant b (no service yet)
        # goes before a's two; a request with no priority is the least important
        assert [b["text"] for b in stats["bodies"]] == ["holder", "vip", "b1", "a1", "a2", "none"]

    run(scenario)
