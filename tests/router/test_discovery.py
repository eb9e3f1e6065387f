"""``--discovery-file``: the file's format and its refusals, and a router following it live: workers
it lists join, workers it drops leave (not the command line's), a broken file changes nothing."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import aiohttp
import pytest

from radixserve.router.discovery import WorkerEntry, parse_workers
from tests.router.router_helpers import Fleet, post, run


def test_the_file_format() -> None:
    assert parse_workers('["http://a:1", {"url": "http://b:2/", "role": "prefill", "bootstrap_port": 8998}]',
                         False) == [WorkerEntry("http://a:1"), WorkerEntry("http://b:2", "prefill", 8998)]
    assert parse_workers("workers:\n  - http://a:1\n  - url: http://c:3\n    role: decode\n", True) == [
        WorkerEntry("http://a:1"), WorkerEntry("http://c:3", "decode")]
    for text, message in (("{", "not JSON"), ('{"x": 1}', "a list of workers"), ('["a:1"]', "http://"),
                          ('[{"url": "http://a", "role": "x"}]', "role"), ('[{"url": "http://a", "port": 1}]', "port"),
                          ('[{"url": "http://a", "bootstrap_port": 0}]', "bootstrap_port"), ("[3]", "a URL")):
        with pytest.raises(ValueError, match=message):
            parse_workers(text, False)


def test_a_router_follows_its_discovery_file(tmp_path: Path) -> None:
    path = tmp_path / "workers.json"

    def write(urls: list[str] | str) -> None:
        tmp = tmp_path / "next.json"
        tmp.write_text(urls if isinstance(urls, str) else json.dumps(urls))
        os.replace(tmp, path)  # as a deployment tool writes it: whole or not at all

    async def scenario(fleet: Fleet, client: aiohttp.ClientSession) -> None:
        a, b, cli = await fleet.stub(), await fleet.stub(), await fleet.stub()
        write([a])
        router = await fleet.start_router([cli], policy="round_robin", discovery_file=str(path),
                                          discovery_interval_secs=0.05)
        assert set(router.workers) == {a, cli}  # read before the first request

        write([a, {"url": b}])
        await fleet.until_workers({a, b, cli})
        ports = {(await post(client, f"{fleet.url}/generate", {"text": "x"}))[1]["worker"] for _ in range(6)}
        assert len(ports) == 3
        write([b])  # a leaves; the command line's worker stays
        await fleet.until_workers({b, cli})
        write("[{broken")  # a half-written file: nothing changes
        await asyncio.sleep(0.3)
        assert set(router.workers) == {b, cli} and router.fleet.discovery.errors >= 1
        write([])
        await fleet.until_workers({cli})

    run(scenario)
