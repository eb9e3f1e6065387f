"""The router's prefill/decode mode against stub workers: both sides get the same body and room,
the client gets the decode side's answer, a failing side cancels the other and the pair is
retried, the loads come back to zero."""

from __future__ import annotations

import aiohttp

from radixserve.bench.stub_worker import create_stub_app
from tests.router.router_helpers import Fleet, free_port, post, run


async def pd_fleet(fleet: Fleet, prefills: int = 1, decodes: int = 1, dp_size: int = 1, **kw: object) -> None:
    ps = []
    for _ in range(prefills):
        port = free_port()
        ps.append(await fleet.stub(create_stub_app(port, dp_size=dp_size, disaggregation_mode="prefill",
                                                   bootstrap_port=9000 + len(ps)), port=port))
    ds = []
    for _ in range(decodes):
        port = free_port()
        # a decode worker answers after the prefill side, as a real one (it waits for the KV) does
        ds.append(await fleet.stub(create_stub_app(port, dp_size=dp_size, disaggregation_mode="decode", delay_ms=50),
                                   port=port))
    await fleet.start_router([], pd_disaggregation=True, prefill_urls=tuple(ps), decode_urls=tuple(ds),
                             policy="round_robin", **kw)


async def bodies(client: aiohttp.ClientSession, url: str) -> list[dict]:
    return list((await (await client.get(f"{url}/stub/stats")).json())["bodies"])


def test_both_sides_get_the_room_and_the_client_gets_the_decode_answer() -> None:
    async def scenario(fleet: Fleet, client: aiohttp.ClientSession) -> None:
        await pd_fleet(fleet)
        assert fleet.router is not None
        (p,), (d,) = fleet.router.args.prefill_urls, fleet.router.args.decode_urls
        status, out = await post(client, f"{fleet.url}/generate", {"text": "hello", "sampling_params": {"x": 1}})
        assert status == 200 and out["worker"] == int(d.rsplit(":", 1)[1])
        (pb,), (db,) = await bodies(client, p), await bodies(client, d)
        assert pb["bootstrap_room"] == db["bootstrap_room"] and 0 <= pb["bootstrap_room"] < 2**63
        assert pb["bootstrap_host"] == db["bootstrap_host"] == "127.0.0.1"
        assert pb["bootstrap_port"] == db["bootstrap_port"] == 9000  # read from the worker's server info
        assert pb["text"] == db["text"] == "hello" and db["sampling_params"] == {"x": 1}
        async with client.post(f"{fleet.url}/v1/chat/completions",
                               json={"messages": [{"role": "user", "content": "hi"}], "stream": True}) as r:
            events = [line async for line in r.content if line.startswith(b"data:")]
        assert len(events) == 5 and fleet.loads() == [0, 0]
        rooms = {b["bootstrap_room"] for b in await bodies(client, d)}
        assert len(rooms) == 2  # a new room per request
        workers = await (await client.get(f"{fleet.url}/workers")).json()
        assert [w["role"] for w in workers["workers"]] == ["prefill", "decode"]

    run(scenario)


def test_dp_aware_pd_sends_both_ranks() -> None:
    async def scenario(fleet: Fleet, client: aiohttp.ClientSession) -> None:
        await pd_fleet(fleet, dp_size=2, dp_aware=True)
        assert fleet.router is not None
        (p,), (d,) = fleet.router.args.prefill_urls, fleet.router.args.decode_urls
        for _ in range(2):
            assert (await post(client, f"{fleet.url}/generate", {"text": "x"}))[0] == 200
        pb, db = await bodies(client, p), await bodies(client, d)
        assert [b["data_parallel_rank"] for b in pb] == [0, 1]
        assert [(b["data_parallel_rank"], b["data_parallel_rank_decode"]) for b in db] == [(0, 0), (1, 1)]

    run(scenario)


def test_a_failing_prefill_cancels_the_decode_side_and_the_pair_is_retried() -> None:
    async def scenario(fleet: Fleet, client: aiohttp.ClientSession) -> None:
        await pd_fleet(fleet, prefills=2)
        assert fleet.router is not None
        bad, good = fleet.router.args.prefill_urls
        await post(client, f"{bad}/stub/fail", {"status": 500, "count": 100})
        for _ in range(3):
            status, _ = await post(client, f"{fleet.url}/generate", {"text": "x"})
            assert status == 200
        assert fleet.loads() == [0, 0, 0]
        metrics = await (await client.get(f"{fleet.url}/metrics")).text()
        assert 'radixserve_router_retries_total{reason="prefill_status_5xx"}' in metrics
        assert 'policy="prefill:round_robin"' in metrics and 'policy="decode:round_robin"' in metrics

    run(scenario)


def test_a_prefill_refusal_is_passed_on_and_a_decode_failure_retried() -> None:
    async def scenario(fleet: Fleet, client: aiohttp.ClientSession) -> None:
        await pd_fleet(fleet, decodes=2)
        assert fleet.router is not None
        (p,) = fleet.router.args.prefill_urls
        await post(client, f"{p}/stub/fail", {"status": 400, "count": 1})
        status, out = await post(client, f"{fleet.url}/generate", {"text": "x"})
        assert status == 400 and out["error"]["message"] == "stub failure"
        bad = fleet.router.args.decode_urls[0]
        await post(client, f"{bad}/stub/fail", {"status": 503, "count": 100})
        for _ in range(2):
            assert (await post(client, f"{fleet.url}/generate", {"text": "x"}))[0] == 200
        assert fleet.loads() == [0, 0, 0]

    run(scenario)


def test_pd_health_needs_both_pools() -> None:
    async def scenario(fleet: Fleet, client: aiohttp.ClientSession) -> None:
        port = free_port()
        p = await fleet.stub(create_stub_app(port, disaggregation_mode="prefill", bootstrap_port=9000), port=port)
        dead = f"http://127.0.0.1:{free_port()}"
        await fleet.start_router([], pd_disaggregation=True, prefill_urls=(p,), decode_urls=(dead,))
        async with client.get(f"{fleet.url}/health") as r:
            assert r.status == 503
        status, out = await post(client, f"{fleet.url}/generate", {"text": "x"})
        assert status == 503 and "decode" in out["error"]["message"]

    run(scenario)
