"""The router's HTTP server (aiohttp, server and keep-alive client in one well-kept library).

    radixserve router --worker-urls http://127.0.0.1:30001 http://127.0.0.1:30002 [--policy cache_aware]

Routes: ``/generate``, ``/v1/completions``, ``/v1/chat/completions`` (routed per request, SSE passed
through as it comes); ``/v1/models``, ``/get_model_info``, ``/get_server_info``, ``/health_generate``
(any eligible worker); ``/flush_cache``, ``/abort_request``, ``/set_schedule_policy`` (every
worker); ``/get_loads`` (every worker's ``/get_load``); ``GET/POST/DELETE /workers`` (the fleet at
run time); ``/health`` (200 while every pool has an eligible worker); ``/metrics`` (Prometheus);
``/dashboard`` (the live page, router/dashboard.py). With ``--api-key`` every route but ``/health``
and the dashboard's page and static files wants ``Authorization: Bearer <key>``; with
``--admin-api-key`` the admin routes (``ADMIN_PATHS``, and adding or removing a worker) want that
key instead (radixserve/auth.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from radixserve import dashboard
from radixserve.auth import SERVER_ADMIN_PATHS, Access
from radixserve.router.config import RouterArgs
from radixserve.router.dashboard import router_state
from radixserve.router.http_common import error_response
from radixserve.router.response_homes import forward_to_home
from radixserve.router.router import Router, routed_paths

logger = logging.getLogger("radixserve.router")
ROUTER_KEY: web.AppKey[Router] = web.AppKey("router", Router)


# worker management: changing the fleet is an admin call, listing it (GET /workers) is not
_FLEET_ADMIN = frozenset({("POST", "/workers"), ("DELETE", "/workers"), ("POST", "/add_worker"),
                          ("POST", "/remove_worker")})


def router_admin_route(method: str, path: str) -> bool:
    return path in SERVER_ADMIN_PATHS or (method, path) in _FLEET_ADMIN


def _auth_middleware(access: Access) -> Any:
    @web.middleware
    async def check(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                    ) -> web.StreamResponse:
        headers = {"authorization": request.headers.get("Authorization", ""),
                   "x-api-key": request.headers.get("X-API-Key", "")}
        refused = access.refusal(request.method, request.path, headers)
        if refused is not None:
            return error_response(refused, 401, "invalid_api_key")
        try:
            return await handler(request)
        except web.HTTPException as e:  # unknown route, wrong method, body too large: OpenAI's error shape
            if e.status < 400:
                raise
            code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(e.status, "http_error")
            return error_response(e.reason or "error", e.status, code)

    return check


async def _worker_url(request: web.Request) -> str | None:
    url = request.query.get("url")
    if url is None and request.can_read_body:
        try:
            body = json.loads(await request.read())
        except ValueError:
            return None
        url = body.get("url") if isinstance(body, dict) else None
    return url if isinstance(url, str) and url.startswith(("http://", "https://")) else None


def create_app(router: Router) -> web.Application:
    access = Access(router.args.api_key, router.args.admin_api_key, router_admin_route)
    app = web.Application(middlewares=[_auth_middleware(access)], client_max_size=64 * 1024 * 1024)
    app[ROUTER_KEY] = router
    _proxied_routes(app, router)
    _admin_routes(app, router)
    _fleet_routes(app, router)
    _observability_routes(app, router)

    async def on_startup(app: web.Application) -> None:
        await router.start()

    async def on_cleanup(app: web.Application) -> None:
        await router.stop()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


def _proxied_routes(app: web.Application, router: Router) -> None:
    """Generation routed per request; what any worker can answer sent to one."""

    def routed(path: str) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handler(request: web.Request) -> web.StreamResponse:
            return await router.proxy(request, path)
        return handler

    for path in routed_paths():
        app.router.add_post(path, routed(path))

    def any_worker(path: str) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handler(request: web.Request) -> web.StreamResponse:
            return await router.forward_one(request, path)
        return handler

    for path in ("/v1/models", "/get_model_info", "/get_server_info", "/health_generate"):
        app.router.add_get(path, any_worker(path))
    for path in ("/tokenize", "/detokenize"):  # every worker serves the same model
        app.router.add_post(path, any_worker(path))

    async def one_model(request: web.Request) -> web.StreamResponse:
        return await router.forward_one(request, request.path)

    app.router.add_get("/v1/models/{model_id:.+}", one_model)

    async def stored_response(request: web.Request) -> web.StreamResponse:
        assert router.session is not None
        return await forward_to_home(request, router.session, router.homes.home(request.match_info["response_id"]),
                                     list(router.workers), router.fleet.auth)

    for path in ("/v1/responses/{response_id}", "/v1/responses/{response_id}/input_items"):
        app.router.add_get(path, stored_response)
    app.router.add_delete("/v1/responses/{response_id}", stored_response)


def _admin_routes(app: web.Application, router: Router) -> None:
    """Calls every worker gets: aborts, policy switches, cache flushes, loads."""

    def every_worker(path: str, all_must: bool) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        """An admin call that each worker gets. ``all_must``: success means every worker said so (a
        policy switch); else one is enough (an abort: the request lives on one worker)."""
        async def handler(request: web.Request) -> web.StreamResponse:
            results = await router.fan_out("POST", path, await request.read(), admin=True)
            said = [s == 200 and isinstance(b, dict) and b.get("success", True) is not False
                    for s, b in results.values()]
            ok = all(said) if all_must else any(said)
            workers = {u: {"status": s, "body": b} for u, (s, b) in results.items()}
            status = 200 if ok or not all_must else 502
            return web.json_response({"success": ok, "workers": workers}, status=status)
        return handler

    app.router.add_post("/abort_request", every_worker("/abort_request", all_must=False))
    app.router.add_post("/set_schedule_policy", every_worker("/set_schedule_policy", all_must=True))

    async def flush_cache(request: web.Request) -> web.Response:
        results = await router.fan_out("POST", "/flush_cache", admin=True)
        ok = all(status == 200 for status, _ in results.values())
        return web.json_response({"success": ok, "workers": {u: {"status": s, "body": b}
                                                              for u, (s, b) in results.items()}},
                                 status=200 if ok else 502)

    async def get_loads(request: web.Request) -> web.Response:
        results = await router.fan_out("GET", "/get_load")
        info = {w["url"]: w for w in router.fleet.describe()}
        return web.json_response({"workers": [{"url": u, "load": b if s == 200 else None,
                                               "router_in_flight": info[u]["load"] if u in info else 0}
                                              for u, (s, b) in results.items()]})

    app.router.add_route("*", "/flush_cache", flush_cache)
    app.router.add_get("/get_loads", get_loads)


def _fleet_routes(app: web.Application, router: Router) -> None:
    """The fleet at run time: list, add and remove workers (sgl-router's names too)."""

    async def list_workers(request: web.Request) -> web.Response:
        return web.json_response({"policy": router.policy.name, "workers": router.fleet.describe()})

    async def add_worker(request: web.Request) -> web.Response:
        url = await _worker_url(request)
        if url is None:
            return error_response('give the worker as ?url=http://host:port or {"url": ...}', 400, "invalid_url")
        if url.rstrip("/") in router.workers:
            return error_response(f"worker {url} is already in the fleet", 409, "worker_exists")
        w = await router.fleet.add_worker(url)
        return web.json_response({"success": True, "url": w.url, "healthy": w.health.healthy})

    async def remove_worker(request: web.Request) -> web.Response:
        url = await _worker_url(request)
        if url is None:
            return error_response('give the worker as ?url=http://host:port or {"url": ...}', 400, "invalid_url")
        if not await router.fleet.remove_worker(url):
            return error_response(f"worker {url} is not in the fleet", 404, "worker_not_found")
        return web.json_response({"success": True, "url": url})

    app.router.add_get("/workers", list_workers)
    app.router.add_post("/workers", add_worker)
    app.router.add_delete("/workers", remove_worker)
    app.router.add_post("/add_worker", add_worker)  # sgl-router's names
    app.router.add_post("/remove_worker", remove_worker)


def _observability_routes(app: web.Application, router: Router) -> None:
    """Health, Prometheus metrics and the live dashboard."""

    async def health(request: web.Request) -> web.Response:
        if router.fleet.serving():
            return web.Response(status=200)
        return error_response("No healthy worker is available.", 503, "no_healthy_worker")

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=router.metrics.render(), content_type="text/plain", charset="utf-8",
                            headers={"X-Content-Type": "version=0.0.4"})

    async def dashboard_page(request: web.Request) -> web.Response:
        return web.Response(body=dashboard.read(dashboard.PAGE), content_type="text/html", charset="utf-8",
                            headers={"Cache-Control": "no-cache"})

    async def dashboard_asset(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in dashboard.ASSETS:
            return error_response(f"no dashboard file {name!r}", 404, "not_found")
        return web.Response(body=dashboard.read(name), headers={"Content-Type": dashboard.ASSETS[name],
                                                                "Cache-Control": "no-cache"})

    async def dashboard_state(request: web.Request) -> web.Response:
        return web.json_response(await router_state(router))

    app.router.add_get("/health", health)
    app.router.add_get("/dashboard", dashboard_page)
    app.router.add_get("/dashboard/static/{name}", dashboard_asset)
    app.router.add_get("/dashboard/state", dashboard_state)
    app.router.add_get("/metrics", metrics)


async def serve(args: RouterArgs, ready: Callable[[], None] | None = None) -> None:
    router = Router(args)
    app = create_app(router)
    # handler_cancellation: a client that goes away cancels its handler, which closes the worker
    # connection, so the worker aborts the request and frees its KV at once.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port, backlog=1024, reuse_address=True)
    await site.start()
    logger.info("router on http://%s:%d, policy %s, %d worker(s)", args.host, args.port, args.policy,
                len(router.workers))
    if ready is not None:
        ready()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        logger.info("router shutting down")
        await runner.cleanup()


def run_router(args: RouterArgs) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="[%(asctime)s Router] %(message)s")
    from radixserve.router.discovery import DiscoveryError

    try:
        asyncio.run(serve(args))
    except (OSError, DiscoveryError) as e:
        logger.error("cannot start: %s", e)
        return 1
    return 0
