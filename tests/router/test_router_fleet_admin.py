"""The router's fleet and admin plane, in one event loop with stub workers (no model): health
ejection and readmission, the workers API, admin calls fanned out to every worker, admin keys."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from aiohttp import web

from radixserve.bench.stub_worker import create_stub_app
from tests.router.router_helpers import Fleet, free_port, post, run


def test_health_checks_eject_and_readmit_and_workers_api() -> None:
    async def scenario(fleet: Fleet, client: aiohttp.ClientSession) -> None:
        a, b = await fleet.stub(), await fleet.stub()
        router = await fleet.start_router([a, b], policy="round_robin", health_check_interval_secs=0.1,
                                          health_failure_threshold=1, health_success_threshold=1)
        port_b = int(b.rsplit(":", 1)[1])
        await fleet.stop_stub(b)
        await asyncio.sleep(0.3)
        assert not router.workers[b].health.healthy
        for _ in range(4):
            status, out = await post(client, f"{fleet.url}/generate", {"text": "x"})
            assert status == 200 and out["worker"] != port_b
        runner = web.AppRunner(create_stub_app(port_b))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port_b).start()
        fleet.runners[b] = runner
        await asyncio.sleep(0.3)
        assert router.workers[b].health.healthy
        listed = await (await client.get(f"{fleet.url}/workers")).json()
        assert [x["url"] for x in listed["workers"]] == [a, b]
        async with client.delete(f"{fleet.url}/workers", params={"url": b}) as r:
            assert r.status == 200
        async with client.delete(f"{fleet.url}/workers", params={"url": b}) as r:
            assert r.status == 404
        async with client.post(f"{fleet.url}/workers", json={"url": b}) as r:
            assert r.status == 200
        async with client.post(f"{fleet.url}/workers", json={"url": b}) as r:
            assert r.status == 409
        async with client.post(f"{fleet.url}/workers", json={"url": "ftp://x"}) as r:
            assert r.status == 400

    run(scenario)


def test_a_worker_whose_port_refuses_after_a_failed_request_leaves_at_once() -> None:
    """Default health settings (3 failed checks, 60 s apart): a request that fails on a worker whose
    port then refuses connections (the process is gone) ejects it at once, and the request succeeds
    on the other worker."""
    async def scenario(fleet: Fleet, client: aiohttp.ClientSession) -> None:
        a, b = await fleet.stub(), await fleet.stub()
        router = await fleet.start_router([a, b], policy="round_robin", health_check_interval_secs=60.0)
        await fleet.stop_stub(b)
        for _ in range(2):
            status, out = await post(client, f"{fleet.url}/generate", {"text": "x"})
            assert status == 200 and out["worker"] == int(a.rsplit(":", 1)[1])
        for _ in range(100):
            if not router.workers[b].health.healthy:
                break
            await asyncio.sleep(0.01)
        assert not router.workers[b].health.healthy and router.workers[a].health.healthy
        assert router.workers[b].health.fails == router.args.health_failure_threshold

    run(scenario)


def test_no_worker_is_503_and_health_follows() -> None:
    async def scenario(fleet: Fleet, client: aiohttp.ClientSession) -> None:
        dead = f"http://127.0.0.1:{free_port()}"
        await fleet.start_router([dead])
        async with client.get(f"{fleet.url}/health") as r:
            assert r.status == 503
        status, out = await post(client, f"{fleet.url}/generate", {"text": "x"})
        assert status == 503 and out["error"]["code"] == "no_healthy_worker"

    run(scenario)


def test_admin_calls_reach_every_worker() -> None:
    async def scenario(fleet: Fleet, client: aiohttp.ClientSession) -> None:
        app_a, app_b = web.Application(), web.Application()
        seen: list[str] = []

        def make(name: str, found: bool) -> Any:
            async def abort(request: web.Request) -> web.Response:
                seen.append(name + ":" + (await request.json())["rid"])
                return web.json_response({"success": found})
            return abort

        async def info(request: web.Request) -> web.Response:
            return web.json_response({"dp_size": 1})

        for app, name, found in ((app_a, "a", False), (app_b, "b", True)):
            app.router.add_post("/abort_request", make(name, found))
            app.router.add_get("/get_server_info", info)
        a, b = await fleet.stub(app_a), await fleet.stub(app_b)
        await fleet.start_router([a, b])
        status, out = await post(client, f"{fleet.url}/abort_request", {"rid": "r1"})
        assert status == 200 and out["success"] is True and sorted(seen) == ["a:r1", "b:r1"]
        async with client.get(f"{fleet.url}/v1/models/default") as r:
            assert r.status == 404  # these stubs have no such route: the worker's answer passes through

    run(scenario)


def test_admin_api_key_guards_admin_and_fleet_routes() -> None:
    """--admin-api-key: the admin routes and the fleet's changes want that key (the ordinary key is
    a 401); it opens every other route too; the admin calls reach the workers with the workers'
    admin key, the rest with their ordinary key."""
    seen: list[tuple[str, str]] = []

    async def record(request: web.Request) -> web.Response:
        seen.append((request.path, request.headers.get("Authorization", "")))
        return web.json_response({"success": True})

    async def info(request: web.Request) -> web.Response:
        return web.json_response({"dp_size": 1})

    async def scenario(fleet: Fleet, client: aiohttp.ClientSession) -> None:
        app = web.Application()
        for path in ("/flush_cache", "/abort_request", "/set_schedule_policy"):
            app.router.add_post(path, record)
        app.router.add_get("/get_load", record)
        app.router.add_get("/get_server_info", info)
        w = await fleet.stub(app)
        await fleet.start_router([w], api_key="user", admin_api_key="root", worker_api_key="w-user",
                                 worker_admin_api_key="w-root")
        user, root = {"Authorization": "Bearer user"}, {"Authorization": "Bearer root"}
        admin_calls = [("POST", "/flush_cache", None), ("POST", "/abort_request", {"rid": "x"}),
                       ("POST", "/set_schedule_policy", {"schedule_policy": "fcfs"}),
                       ("POST", "/workers", {"url": "http://127.0.0.1:9"}),
                       ("DELETE", "/workers", {"url": "http://127.0.0.1:9"}),
                       ("POST", "/add_worker", {"url": "http://127.0.0.1:9"}),
                       ("POST", "/remove_worker", {"url": "http://127.0.0.1:9"})]
        for method, path, body in admin_calls:
            for headers in ({}, user, {"X-API-Key": "user"}, {"Authorization": "Bearer wrong"}):
                async with client.request(method, fleet.url + path, json=body, headers=headers) as r:
                    err = (await r.json())["error"]
                    assert r.status == 401 and err["code"] == "invalid_api_key", (path, headers)
                    assert "--admin-api-key" in err["message"]
        assert seen == []  # nothing refused reached a worker
        for method, path, body in admin_calls:
            async with client.request(method, fleet.url + path, json=body, headers=root) as r:
                assert r.status == 200, (path, await r.text())
        assert seen == [("/flush_cache", "Bearer w-root"), ("/abort_request", "Bearer w-root"),
                        ("/set_schedule_policy", "Bearer w-root")]
        # an ordinary route: the ordinary key or the admin key, never none; /health stays open
        for headers, status in (({}, 401), (user, 200), (root, 200)):
            async with client.get(f"{fleet.url}/get_loads", headers=headers) as r:
                assert r.status == status, headers
            async with client.get(f"{fleet.url}/workers", headers=headers) as r:
                assert r.status == status, headers
        assert seen[-1] == ("/get_load", "Bearer w-user")
        async with client.get(f"{fleet.url}/health") as r:
            assert r.status == 200

    run(scenario)


def test_admin_api_key_alone_leaves_the_data_routes_open() -> None:
    async def scenario(fleet: Fleet, client: aiohttp.ClientSession) -> None:
        w = await fleet.stub()
        await fleet.start_router([w], admin_api_key="root")
        assert (await post(client, f"{fleet.url}/generate", {"text": "x"}))[0] == 200
        async with client.post(f"{fleet.url}/flush_cache") as r:
            assert r.status == 401
        async with client.post(f"{fleet.url}/flush_cache", headers={"Authorization": "Bearer root"}) as r:
            assert r.status == 200  # no --worker-admin-api-key: the stub, which wants none, got "root"

    run(scenario)


def test_a_worker_back_from_the_dead_loses_its_cache_tree_before_it_takes_traffic() -> None:
    """The moment health checks readmit a worker, its prefix-tree state is gone (a restarted process
    has an empty cache), even while reading its server info again is still under way: stale state
    would steer the first requests away from it."""
    async def scenario(fleet: Fleet, client: aiohttp.ClientSession) -> None:
        a, b = await fleet.stub(), await fleet.stub()
        router = await fleet.start_router([a, b], policy="cache_aware", health_failure_threshold=1,
                                          health_success_threshold=1)
        w = router.workers[b]
        policy = router.policies[None]
        key = w.targets[0].key
        policy.tree.insert("an old prompt, long since routed to b " * 8, key)
        assert policy.tree.tenant_size(key) > 0
        port_b = int(b.rsplit(":", 1)[1])
        await fleet.stop_stub(b)
        await router.fleet.check_worker(w)
        assert not w.health.healthy

        slow = web.Application()  # healthy at once, slow to describe itself

        async def health(_r: web.Request) -> web.Response:
            return web.Response(text="ok")

        async def info(_r: web.Request) -> web.Response:
            await asyncio.sleep(30)
            return web.json_response({})

        slow.router.add_get("/health", health)
        slow.router.add_get("/get_server_info", info)
        runner = web.AppRunner(slow, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port_b).start()
        fleet.runners[b] = runner
        check = asyncio.create_task(router.fleet.check_worker(w))
        await asyncio.sleep(0.3)
        assert w.health.healthy and not check.done()  # readmitted; its info is still being read
        assert policy.tree.tenant_size(key) == 0
        check.cancel()

    run(scenario)
