"""In-process fleets for the router's tests: stub workers and a router in one event loop."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import aiohttp
from aiohttp import web

from radixserve.bench.stub_worker import create_stub_app
from radixserve.router.app import create_app
from radixserve.router.config import RouterArgs
from radixserve.router.router import Router


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Fleet:
    """Stub workers and a router, all in this event loop."""

    def __init__(self) -> None:
        self.runners: dict[str, web.AppRunner] = {}
        self.router: Router | None = None
        self.url = ""

    async def stub(self, app: web.Application | None = None, port: int | None = None, **kw: Any) -> str:
        port = port or free_port()
        runner = web.AppRunner(app or create_stub_app(port, **kw), handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        url = f"http://127.0.0.1:{port}"
        self.runners[url] = runner
        return url

    async def stop_stub(self, url: str) -> None:
        await self.runners.pop(url).cleanup()

    async def start_router(self, workers: list[str], **kw: Any) -> Router:
        kw.setdefault("retry_initial_backoff_ms", 1)
        kw.setdefault("health_check_interval_secs", 60.0)
        args = RouterArgs(worker_urls=tuple(workers), worker_startup_timeout_secs=1.0, **kw)
        self.router = Router(args)
        port = free_port()
        runner = web.AppRunner(create_app(self.router), handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        self.runners["router"] = runner
        self.url = f"http://127.0.0.1:{port}"
        return self.router

    async def until_workers(self, urls: set[str], timeout: float = 5.0) -> None:
        """Wait until the router's workers are exactly ``urls`` (discovery acts in the background)."""
        assert self.router is not None
        for _ in range(int(timeout / 0.05)):
            if set(self.router.workers) == urls:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"workers {set(self.router.workers)}, wanted {urls}")

    def loads(self) -> list[int]:
        assert self.router is not None
        return [t.load for w in self.router.workers.values() for t in w.targets]

    async def close(self) -> None:
        for r in reversed(list(self.runners.values())):
            await r.cleanup()


def run(scenario: Callable[[Fleet, aiohttp.ClientSession], Awaitable[None]]) -> None:
    async def main() -> None:
        fleet = Fleet()
        try:
            async with aiohttp.ClientSession() as client:
                await scenario(fleet, client)
        finally:
            await fleet.close()

    asyncio.run(main())


async def post(client: aiohttp.ClientSession, url: str, body: dict[str, Any], **kw: Any) -> tuple[int, Any]:
    async with client.post(url, json=body, **kw) as r:
        text = await r.text()
        try:
            return r.status, json.loads(text)
        except ValueError:
            return r.status, text


@contextmanager
def router_in_thread(workers: list[str], **kw: Any) -> Iterator[Fleet]:
    """A router in front of ``workers`` (real servers), on an event loop of its own thread, for
    tests that talk to it with blocking clients; yields the fleet (``.url``, ``.router``)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    fleet = Fleet()
    try:
        asyncio.run_coroutine_threadsafe(fleet.start_router(workers, **kw), loop).result(60)
        yield fleet
    finally:
        asyncio.run_coroutine_threadsafe(fleet.close(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
