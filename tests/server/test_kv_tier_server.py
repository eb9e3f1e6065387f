"""The KV tier through a real server: a prompt evicted from a small pool is loaded back (the
figures in /get_server_info, /metrics, /debug/memory and the dashboard's snapshot say so), and a
server killed with SIGKILL and started again over the same directory finds its prefixes."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.helpers import ServerProcess, assert_memory_ok, started, wait_idle

pytestmark = pytest.mark.slow  # real servers: the full tier only

GREEDY = {"max_new_tokens": 4, "temperature": 0}


def text(i: int) -> str:
    return " ".join(f"Entry {j} of ledger {i}: {j * 13 + i} units of item {(j * 7 + i) % 50} were moved." for j in range(25))


def tiered(tier_dir: Path, *extra: str) -> ServerProcess:
    return ServerProcess("--max-total-tokens", "1024", "--enable-metrics", "--enable-hierarchical-cache", "--hicache-ratio", "16",
                         "--hicache-storage-dir", str(tier_dir), *extra)


def gen(c: httpx.Client, i: int) -> dict[str, Any]:
    r = c.post("/generate", json={"text": text(i), "sampling_params": GREEDY})
    assert r.status_code == 200, r.text
    return r.json()


def evicted_and_back(c: httpx.Client) -> tuple[dict[str, Any], int]:
    """Prompt 0 twice (a pool hit), four others that evict it from the small pool, then prompt 0
    again: nearly all of it comes back from the tier, with the pool hit's output. Returns the pool
    hit and the prompt's length."""
    gen(c, 0)
    hit = gen(c, 0)
    for i in range(1, 5):
        gen(c, i)
    back = gen(c, 0)
    n = back["meta_info"]["prompt_tokens"]
    assert back["meta_info"]["cached_tokens"] >= n - 64 and back["output_ids"] == hit["output_ids"]
    return hit, n


def tier_info(c: httpx.Client) -> dict[str, Any]:
    info = c.get("/get_server_info").json()["kv_tier"]
    assert info is not None and len(info) == 1
    return info[0]


def test_the_tier_through_the_server_and_a_restart(tmp_path: Path) -> None:
    it = started(tiered(tmp_path))
    srv = next(it)
    try:
        with srv.client() as c:
            hit, n = evicted_and_back(c)
            t = tier_info(c)
            assert t["enabled"] and t["backend"] == "file" and t["hit_tokens"] >= n // 2 and t["loads"] >= 1
            metrics = c.get("/metrics").text
            assert "radixserve:hicache_hit_tokens_total" in metrics and "radixserve:hicache_bytes_written_total" in metrics
            mem = wait_idle(c)
            assert_memory_ok(mem)
            assert mem["tier"]["used_bytes"] > 0
            dash = c.get("/dashboard/state").json()
            assert dash["ranks"][0]["tier"]["hit_tokens"] >= n // 2
            for _ in range(100):  # every write landed (then a SIGKILL loses nothing)
                t = tier_info(c)
                if t["blocks_written"] + t["write_errors"] >= t["blocks"]:
                    break
                time.sleep(0.05)
    finally:
        it.close()  # (kills the server: SIGKILL)
    again = started(tiered(tmp_path))
    srv2 = next(again)
    try:
        with srv2.client() as c:
            first = gen(c, 0)
            assert first["meta_info"]["cached_tokens"] >= n - 64 and first["output_ids"] == hit["output_ids"]
            assert tier_info(c)["hit_tokens"] >= n // 2
            assert_memory_ok(wait_idle(c))
    finally:
        again.close()


def test_quantized_kv_through_the_server_and_its_tier(tmp_path: Path) -> None:
    """``--kv-cache-dtype int8`` with the tier: a prompt evicted from the pool comes back from the
    tier with the pool hit's output; a server over the same directory with another format finds none
    of those blocks (they are named per format) and computes the prompt."""
    it = started(tiered(tmp_path, "--kv-cache-dtype", "int8"))
    srv = next(it)
    try:
        with srv.client() as c:
            assert c.get("/get_server_info").json()["kv_cache_dtype"] == "int8"
            hit, n = evicted_and_back(c)
            assert tier_info(c)["hit_tokens"] >= n // 2
            mem = wait_idle(c)
            assert_memory_ok(mem)
            assert mem["kv_format"] == "int8" and mem["kv_bytes_per_token"] == 2 * 30 * 3 * (64 + 4)
    finally:
        it.close()
    other = started(tiered(tmp_path, "--kv-cache-dtype", "fp8_e5m2"))
    srv2 = next(other)
    try:
        with srv2.client() as c:
            first = gen(c, 0)
            assert first["meta_info"]["cached_tokens"] == 0 and len(first["output_ids"]) == GREEDY["max_new_tokens"]
            assert tier_info(c)["hit_tokens"] == 0
            assert_memory_ok(wait_idle(c))
    finally:
        other.close()
