"""Per-tenant rate limits at the router: the token buckets (a fake clock), the config file's checks,
and a router in front of a stub worker: a tenant over its limit gets 429 with the Retry-After its
bucket gives, at once, while other tenants go on; the counters per tenant."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import aiohttp
import pytest

from radixserve.router.config import RouterArgs
from radixserve.router.rate_limits import RateLimits
from tests.router.router_helpers import Fleet, run


def test_buckets_refill_at_their_rate_and_refuse_without_taking() -> None:
    rl = RateLimits.from_dict({"default": {"requests_per_second": 0.5, "request_burst": 2},
                               "tenants": {"big": {"tokens_per_second": 100, "token_burst": 300}}})
    assert [rl.admit("a", 10, 0.0) for _ in range(3)] == [None, None, 2]  # burst 2, then 2 s for the next
    assert rl.admit("a", 10, 1.0) == 1  # half refilled: 1 s more
    assert rl.admit("a", 10, 2.0) is None and rl.admit("a", 10, 2.0) == 2
    assert rl.admit("b", 10, 2.0) is None  # another tenant: its own buckets
    # "big" takes the default's request limit and its own token limit
    assert rl.admit("big", 250, 0.0) is None
    assert rl.admit("big", 100, 0.0) == 1  # 50 tokens left: 0.5 s, rounded up
    assert rl.admit("big", 1000, 10.0) is None  # above the burst: counts as the burst (300, full again)
    assert rl.admit("big", 1, 10.0) == 1  # its requests bucket (burst 2) is empty now
    assert RateLimits.from_dict({}).admit("anyone", 1e9, 0.0) is None  # no limits set: none
    assert (rl.label("big"), rl.label("stranger")) == ("big", "default")


@pytest.mark.parametrize("data, message", [
    ([1], "must be an object"),
    ({"default": {"requests_per_second": -1}}, "default.requests_per_second must be a number > 0"),
    ({"tenants": {"a": {"rps": 1}}}, "tenants.a.rps is not a limit"),
    ({"tenants": ["a"]}, "'tenants' in"),
    ({"default": {"token_burst": True}}, "must be a number > 0"),
])
def test_bad_configs_are_refused_by_name(data: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RateLimits.from_dict(data)


def test_the_router_checks_its_file_at_start(tmp_path: Path) -> None:
    bad = tmp_path / "limits.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="is not JSON"):
        RouterArgs(worker_urls=("http://127.0.0.1:1",), tenant_rate_limit_config=str(bad))
    with pytest.raises(ValueError, match="cannot read"):
        RouterArgs(worker_urls=("http://127.0.0.1:1",), tenant_rate_limit_config=str(tmp_path / "none.json"))


def test_a_tenant_over_its_limit_is_refused_at_once_and_others_go_on(tmp_path: Path) -> None:
    path = tmp_path / "limits.json"
    path.write_text(json.dumps({"default": {"requests_per_second": 0.2, "request_burst": 2},
                                "tenants": {"vip": {"requests_per_second": 1000, "request_burst": 1000}}}))

    async def scenario(fleet: Fleet, client: aiohttp.ClientSession) -> None:
        worker = await fleet.stub(delay_ms=200)  # every request holds the router's only slot for 200 ms
        await fleet.start_router([worker], policy="round_robin", tenant_rate_limit_config=str(path),
                                 max_concurrent_requests=1, queue_size=64)

        async def ask(tenant: str, user: bool = False) -> tuple[int, str | None, float]:
            t0 = time.perf_counter()
            body = {"prompt": "hi", "max_tokens": 2, **({"user": tenant} if user else {})}
            async with client.post(f"{fleet.url}/v1/completions", json=body,
                                   headers={} if user else {"x-tenant": tenant}) as r:
                await r.read()
                return r.status, r.headers.get("Retry-After"), time.perf_counter() - t0

        first = await asyncio.gather(*(ask("free") for _ in range(2)), *(ask("vip") for _ in range(6)))
        assert [s for s, _, _ in first] == [200] * 8
        over = await asyncio.gather(*(ask("free") for _ in range(5)), ask("other", user=True), ask("vip"))
        assert [s for s, _, _ in over[:5]] == [429] * 5
        (retry,) = {ra for _, ra, _ in over[:5]}  # one bucket, read at about the same time
        assert retry is not None and 1 <= int(retry) <= 5  # (1 - what refilled since) / 0.2 per second
        # refused at once: before either admitted request (each 200 ms at the worker) is answered
        assert max(dt for _, _, dt in over[:5]) < min(dt for _, _, dt in over[5:])
        assert over[5][0] == over[6][0] == 200  # another tenant (here by its OpenAI user field), a configured one
        async with client.get(f"{fleet.url}/metrics") as r:
            text = await r.text()
        assert 'radixserve_router_tenant_requests_total{outcome="rate_limited",tenant="default"} 5.0' in text
        assert 'radixserve_router_tenant_requests_total{outcome="admitted",tenant="vip"} 7.0' in text
        assert 'radixserve_router_rejected_total{reason="tenant_rate_limit"} 5.0' in text

    run(scenario)
