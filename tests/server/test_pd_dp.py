"""Prefill/decode disaggregation with data parallelism on both sides: a ``--dp-size 2`` prefill worker
and a ``--dp-size 2`` decode worker. The request names the prefill rank (``data_parallel_rank``,
whose bootstrap server is the base port + rank) and the decode rank (``data_parallel_rank_decode``);
the answer comes from the decode rank asked for and equals a colocated worker's."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.server.helpers import ServerProcess, assert_memory_ok, free_port, post_disaggregated, wait_idle

pytestmark = pytest.mark.slow  # real servers: the full tier only (scripts/test.sh --fast leaves it out)


@pytest.fixture(scope="module")
def pd_dp() -> Iterator[tuple[ServerProcess, ServerProcess, int]]:
    bport = free_port()
    prefill = ServerProcess("--dp-size", "2", "--disaggregation-mode", "prefill",
                            "--disaggregation-bootstrap-port", str(bport))
    decode = ServerProcess("--dp-size", "2", "--disaggregation-mode", "decode")
    try:
        prefill.wait_ready()
        decode.wait_ready()
        yield prefill, decode, bport
    finally:
        prefill.kill()
        decode.kill()


def _native(prompt: str) -> dict[str, Any]:
    return {"text": prompt, "sampling_params": {"temperature": 0.0, "max_new_tokens": 8}}


@pytest.mark.parametrize(("p_rank", "d_rank"), [(0, 1), (1, 0)])
def test_ranks_on_both_sides(pd_dp: tuple[ServerProcess, ServerProcess, int], shared_server: ServerProcess,
                             p_rank: int, d_rank: int) -> None:
    prefill, decode, bport = pd_dp
    prompt = f"Rank {p_rank} to rank {d_rank}: the capital of France is"
    want = httpx.post(shared_server.url + "/generate", json=_native(prompt), timeout=60).json()
    body = {**_native(prompt), "bootstrap_host": "127.0.0.1", "bootstrap_port": bport,
            "bootstrap_room": random.getrandbits(63), "data_parallel_rank": p_rank,
            "data_parallel_rank_decode": d_rank}
    got = post_disaggregated(prefill.url, decode.url, body, timeout=60)
    assert got.status_code == 200, got.text
    out = got.json()
    assert out["meta_info"]["dp_rank"] == d_rank
    assert out["output_ids"] == want["output_ids"]


def test_idle_after(pd_dp: tuple[ServerProcess, ServerProcess, int]) -> None:
    for srv in pd_dp[:2]:
        assert_memory_ok(wait_idle(srv.client(), timeout=20))  # type: ignore[union-attr]
