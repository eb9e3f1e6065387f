"""Tensor parallelism through the server: ``radixserve serve --tp-size 2`` answers the same greedy
tokens as ``--tp-size 1``; rank 1 is a child process that stops with the server, and its death
fails /health and ends the server non-zero; two "nodes" (two serve commands, --nnodes 2) on this
machine work; a tp size the model's heads do not allow is refused before anything starts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.model.tiny_llama import make_tiny_llama
from tests.server.helpers import REPO, ServerProcess, free_port, pid_alive

pytestmark = pytest.mark.slow  # real servers: the full tier only (scripts/test.sh --fast leaves it out)

PREFIX = "A shared system prompt that several requests start with: "
PROMPTS = [PREFIX + "first question?", PREFIX + "second, longer question here?", "short"]
GREEDY = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="radixserve-tiny-") as d:
        yield make_tiny_llama(d)


@pytest.fixture(scope="module")
def reference(tiny: str) -> list[list[int]]:
    from radixserve.engine import Engine

    outs = Engine(tiny, dtype="float32", max_total_tokens=2048).generate(PROMPTS, GREEDY)
    assert isinstance(outs, list)
    return [o["output_ids"] for o in outs]


def _serve(tiny: str, *extra: str) -> ServerProcess:
    return ServerProcess("--model-path", tiny, "--dtype", "float32", *extra)


def _generate_all(srv: ServerProcess) -> list[list[int]]:
    with srv.client() as c:
        outs = []
        for p in PROMPTS:
            r = c.post("/generate", json={"text": p, "sampling_params": GREEDY})
            assert r.status_code == 200, r.text
            outs.append(r.json())
    assert outs[1]["meta_info"]["cached_tokens"] >= len(PREFIX) - 1
    return [o["output_ids"] for o in outs]


def _stop(srv: ServerProcess) -> None:
    srv.kill()
    os.unlink(srv.log.name)


def test_tp2_server_equals_tp1_and_stops_with_its_ranks(tiny: str, reference: list[list[int]]) -> None:
    tp1, tp2 = _serve(tiny), _serve(tiny, "--tp-size", "2")
    try:
        tp1.wait_ready()
        tp2.wait_ready()
        assert _generate_all(tp1) == reference
        assert _generate_all(tp2) == reference
        assert {"scheduler", "tp_1", "detokenizer"} <= set(tp2.pids)
        info = httpx.get(f"{tp2.url}/get_server_info", timeout=10).json()
        assert info["tp_size"] == 2 and info["dist_init_addr"].startswith("127.0.0.1:")
        assert "per tensor-parallel rank: 1/2 of the KV heads" in tp2.log_text()
        code = tp2.interrupt()
        assert code == 0, tp2.log_text()[-3000:]
        time.sleep(0.5)
        left = [name for name, pid in tp2.pids.items() if name != "http" and pid_alive(pid)]
        assert not left, f"processes left after Ctrl-C: {left}"
    finally:
        _stop(tp1)
        _stop(tp2)


def test_a_dead_tp_rank_fails_health_and_ends_the_server(tiny: str) -> None:
    srv = _serve(tiny, "--tp-size", "2")
    try:
        srv.wait_ready()
        with srv.client() as c, c.stream("POST", "/generate", json={
                "text": "Once", "stream": True, "sampling_params": {**GREEDY, "max_new_tokens": 400}}) as r:
            lines = r.iter_lines()
            next(ln for ln in lines if ln.startswith("data:"))
            os.kill(srv.pids["tp_1"], signal.SIGKILL)
            rest = [ln[5:].strip() for ln in lines if ln.startswith("data:")]
        assert any('"error"' in ln for ln in rest), rest[-3:]  # the stream ends with an error, no hang
        health_failed = False
        deadline = time.monotonic() + 30
        while srv.proc.poll() is None and time.monotonic() < deadline:
            try:
                health_failed |= httpx.get(f"{srv.url}/health", timeout=2).status_code != 200
            except httpx.HTTPError:
                health_failed = True
            time.sleep(0.05)
        assert srv.proc.wait(timeout=5) != 0
        assert health_failed
        time.sleep(0.5)
        left = [name for name, pid in srv.pids.items() if name != "http" and pid_alive(pid)]
        assert not left, f"processes outlived the server: {left}"
    finally:
        _stop(srv)


def test_two_nodes_on_one_machine(tiny: str, reference: list[list[int]]) -> None:
    """Node 1 runs only TP rank 1; node 0 the HTTP server and rank 0. Ctrl-C on node 0 ends both."""
    addr = f"127.0.0.1:{free_port()}"
    dist = ["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", addr]
    log = tempfile.NamedTemporaryFile(prefix="radixserve-test-node1-", suffix=".log", delete=False)
    node1 = subprocess.Popen([sys.executable, "-m", "radixserve.cli", "serve", "--model-path", tiny, "--dtype",
                              "float32", *dist, "--node-rank", "1"], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
    node0 = _serve(tiny, *dist, "--node-rank", "0")
    try:
        node0.wait_ready()
        assert "tp_1" not in node0.pids  # rank 1 lives on node 1
        assert _generate_all(node0) == reference
        assert node0.interrupt() == 0
        assert node1.wait(timeout=20) == 0, open(log.name).read()[-3000:]
    finally:
        _stop(node0)
        if node1.poll() is None:
            os.killpg(node1.pid, signal.SIGKILL)
            node1.wait(10)
        os.unlink(log.name)


def test_serve_refuses_a_tp_size_the_heads_do_not_allow() -> None:
    # the bundled SmolLM2 has 9 query and 3 KV heads
    out = subprocess.run([sys.executable, "-m", "radixserve.cli", "serve", "--tp-size", "2", "--port",
                          str(free_port())], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "--tp-size 2 does not divide this model's num_attention_heads = 9 and num_key_value_heads = 3" in (
        out.stderr + out.stdout)
    assert json.dumps([1, 3])[1:-1] in out.stderr + out.stdout  # the sizes that would work
