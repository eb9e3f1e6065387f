"""``radixserve bench serve`` against a real server: each workload, small, checked through the JSON
report it writes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.server.helpers import ServerProcess

pytestmark = pytest.mark.slow  # real servers: the full tier only (scripts/test.sh --fast leaves it out)


def _bench(server: ServerProcess, out: Path, *args: str) -> dict[str, Any]:
    from radixserve.cli import main

    code = main(["bench", "serve", "--base-url", server.url, "--output", str(out), "--disable-tqdm", *args])
    assert code == 0
    rep: dict[str, Any] = json.loads(out.read_text())
    for key in ("ttft", "tpot", "itl", "e2e_latency"):
        assert rep[key]["p50_ms"] is not None and rep[key]["p99_ms"] >= rep[key]["p50_ms"], key
    assert rep["output_throughput"] > 0
    return rep


def test_bench_serve_shared_prefix(shared_server: ServerProcess, tmp_path: Path) -> None:
    png = tmp_path / "bench.png"
    rep = _bench(shared_server, tmp_path / "bench.json", "--workload", "shared-prefix", "--num-groups", "2",
                 "--num-prompts", "2", "--system-len", "32", "--question-len", "8", "--output-len", "4",
                 "--request-rate", "20", "--max-concurrency", "4", "--plot", str(png))
    assert rep["completed"] == 4 and rep["failed"] == 0 and rep["total_output_tokens"] == 16
    assert png.stat().st_size > 1000


def test_bench_serve_random(shared_server: ServerProcess, tmp_path: Path) -> None:
    rep = _bench(shared_server, tmp_path / "bench.json", "--workload", "random", "--num-prompts", "3",
                 "--input-len", "12", "--output-len", "3", "--max-concurrency", "2", "--seed", "7")
    assert rep["workload"] == "random" and rep["max_concurrency"] == 2
    assert rep["completed"] == 3 and rep["failed"] == 0 and rep["errors"] == {}
    assert rep["total_input_tokens"] == 36 and rep["total_output_tokens"] == 9
    assert "multi_turn_replies" not in rep
    for r in rep["requests"]:
        assert r["ok"] and r["prompt_len"] == 12 and r["output_tokens"] == 3 and r["ttft"] > 0
        assert isinstance(r["cached_tokens"], int)


def test_bench_serve_multi_turn(shared_server: ServerProcess, tmp_path: Path) -> None:
    """Every turn is the previous turn's prompt + the reply the server really generated + new user
    tokens: the lengths add up, and the server's radix cache hits on the whole history, reply
    included (a random stand-in for the reply would match only the previous prompt)."""
    convs, turns, first, turn_len, out_len = 2, 3, 16, 8, 4
    rep = _bench(shared_server, tmp_path / "bench.json", "--workload", "multi-turn", "--num-prompts", str(convs),
                 "--num-turns", str(turns), "--input-len", str(first), "--turn-len", str(turn_len),
                 "--output-len", str(out_len), "--max-concurrency", "2", "--seed", "3")
    assert rep["completed"] == convs * turns and rep["failed"] == 0
    assert rep["multi_turn_replies"] == {"real": convs * turns, "stand_in": 0}
    by_conv: dict[int, list[dict[str, Any]]] = {}
    for r in rep["requests"]:
        by_conv.setdefault(r["group"], []).append(r)
    assert sorted(by_conv) == list(range(convs))
    for reqs in by_conv.values():
        reqs.sort(key=lambda r: r["turn"])
        assert [r["turn"] for r in reqs] == list(range(turns))
        assert reqs[0]["prompt_len"] == first
        for prev, cur in zip(reqs, reqs[1:], strict=False):
            assert prev["output_tokens"] == out_len
            assert cur["prompt_len"] == prev["prompt_len"] + out_len + turn_len
            # the reply's last token has no KV yet when the request ends: all but it is cached
            assert cur["cached_tokens"] >= prev["prompt_len"] + out_len - 1, (prev, cur)
