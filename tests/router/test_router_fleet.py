"""A real fleet: ``radixserve launch --num-workers 3`` (three ``radixserve serve`` workers with the
model, and the router), driven through the router with the ``openai`` client and
``radixserve bench serve``. A worker killed under load must leave rotation within one
health interval and no accepted request is lost, after a rolling restart of all three workers
(SIGTERM: each drains and exits) under steady load that failed no request. The fixture's
teardown is a check too: Ctrl-C stops the router and every worker, with exit code 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from radixserve.router.launch import StartFailed, wait_healthy
from tests.server.helpers import REPO, STARTUP_TIMEOUT_S, assert_memory_ok, free_port, pid_alive, wait_idle

pytestmark = pytest.mark.slow  # real servers: the full tier only (scripts/test.sh --fast leaves it out)

HEALTH_INTERVAL_S = 1.0


class LaunchedFleet:
    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.worker_ports = [self.port + 1, self.port + 2, self.port + 3]
        self.log = tempfile.NamedTemporaryFile(prefix="radixserve-test-fleet-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "radixserve.cli", "launch", "--num-workers", "3", "--port", str(self.port),
               "--max-total-tokens", "4096", "--dp-aware", "--policy", "cache_aware",
               "--health-check-interval-secs", str(HEALTH_INTERVAL_S), "--health-failure-threshold", "1",
               "--health-success-threshold", "1", "--retry-initial-backoff-ms", "20"]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
        self.extra: list[subprocess.Popen[bytes]] = []

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        try:
            wait_healthy({self.url: self.proc}, STARTUP_TIMEOUT_S)
        except StartFailed as e:
            raise RuntimeError(f"{e}:\n{self.log_text()[-4000:]}") from None
        while not all(w["healthy"] for w in self.workers()):  # the router's own checks, a moment later
            if time.monotonic() > deadline:
                raise RuntimeError(f"fleet not ready in {STARTUP_TIMEOUT_S}s:\n{self.log_text()[-4000:]}")
            time.sleep(0.1)

    def workers(self) -> list[dict[str, Any]]:
        return list(httpx.get(f"{self.url}/workers", timeout=5).json()["workers"])

    def log_text(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def worker_pids(self, port: int) -> list[int]:
        info = httpx.get(f"http://127.0.0.1:{port}/get_server_info", timeout=10).json()
        return list(info["pids"].values())

    def kill(self) -> None:
        for p in [self.proc, *self.extra]:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)


@pytest.fixture(scope="module")
def fleet() -> Iterator[LaunchedFleet]:
    f = LaunchedFleet()
    try:
        f.wait_ready()
        pids = [pid for port in f.worker_ports for pid in f.worker_pids(port)]
        yield f
        assert all(w["load"] == 0 for w in f.workers()), f.workers()  # the router's counts never leak
        os.killpg(f.proc.pid, signal.SIGINT)  # Ctrl-C, as a terminal sends it
        code = f.proc.wait(60)
        assert code == 0, f"Ctrl-C exit code {code}:\n{f.log_text()[-3000:]}"
        time.sleep(0.5)
        restarted = [p.pid for p in f.extra]
        left = [p for p in pids if pid_alive(p) and p not in restarted]
        assert not left, f"orphan worker processes after Ctrl-C: {left}"
    finally:
        f.kill()
        os.unlink(f.log.name)


def test_openai_client_streams_through_the_router(fleet: LaunchedFleet) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{fleet.url}/v1", api_key="none")
    chunks = list(client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Name three colours."}], max_tokens=12,
        temperature=0, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].choices[0].finish_reason in ("length", "stop")
    done = client.completions.create(model="default", prompt="The capital of France is", max_tokens=4,
                                     temperature=0)
    assert done.usage is not None and done.usage.completion_tokens == 4


def test_cache_aware_keeps_a_prefix_on_one_worker_and_it_hits(fleet: LaunchedFleet) -> None:
    system = "You are a careful assistant who answers in one short sentence. " * 4
    outs = [httpx.post(f"{fleet.url}/generate", json={"text": system + f"Question {i}: what is {i} + {i}?",
                                                      "sampling_params": {"max_new_tokens": 2}}, timeout=60).json()
            for i in range(4)]
    assert all(o["meta_info"]["cached_tokens"] > 0 for o in outs[1:]), [o["meta_info"] for o in outs]
    metrics = httpx.get(f"{fleet.url}/metrics", timeout=5).text
    assert 'branch="cache_hit",policy="cache_aware"' in metrics


def test_dp_aware_rank_is_accepted_and_validated_by_the_worker(fleet: LaunchedFleet) -> None:
    # the router sent data_parallel_rank 0 with every request above; a rank the worker lacks is a 400
    r = httpx.post(f"http://127.0.0.1:{fleet.worker_ports[0]}/generate",
                   json={"text": "hi", "data_parallel_rank": 1, "sampling_params": {"max_new_tokens": 1}}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "data_parallel_rank"
    assert all(t["dp_rank"] == 0 for w in fleet.workers() for t in w["targets"])


def test_bench_serve_through_the_router(fleet: LaunchedFleet, tmp_path: Path) -> None:
    from radixserve.cli import main

    out = tmp_path / "bench.json"
    code = main(["bench", "serve", "--base-url", fleet.url, "--output", str(out), "--disable-tqdm",
                 "--workload", "multi-turn", "--num-prompts", "2", "--num-turns", "2", "--input-len", "16",
                 "--turn-len", "8", "--output-len", "3", "--max-concurrency", "2", "--seed", "1"])
    rep = json.loads(out.read_text())
    assert code == 0 and rep["completed"] == 4 and rep["failed"] == 0


def _start_worker(fleet: LaunchedFleet, port: int) -> subprocess.Popen[bytes]:
    """A worker on ``port`` (as launch starts them), tracked by the fixture; waits until the router
    has it back in rotation."""
    log = open(os.devnull, "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "radixserve.cli", "serve", "--port", str(port), "--max-total-tokens", "4096",
         "--num-threads", "1"], cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    fleet.extra.append(proc)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S

    def up() -> bool:  # the new process answers, not the router's memory of the old one
        try:
            return httpx.get(f"{url}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    while not up():
        assert proc.poll() is None, f"the worker on :{port} exited with {proc.returncode}"
        assert time.monotonic() < deadline, f"the worker on :{port} never came back"
        time.sleep(0.25)
    # the router may not have noticed the old process was gone (a probe interval is longer than a
    # drain): either way it must list the worker as taking traffic before the next one stops
    while not (w := next(w for w in fleet.workers() if w["url"] == url))["healthy"] or not w["eligible"]:
        assert time.monotonic() < deadline, f"the router never took :{port} back: {w}"
        time.sleep(0.25)
    return proc


def _sent_to(fleet: LaunchedFleet, url: str) -> float:
    for line in httpx.get(f"{fleet.url}/metrics", timeout=5).text.splitlines():
        if line.startswith("radixserve_router_requests_total") and f'worker="{url}"' in line \
                and 'route="/generate"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_rolling_restart_under_steady_load_loses_nothing(fleet: LaunchedFleet) -> None:
    """Under steady load, each worker in turn gets SIGTERM (it drains: /health says so, the router
    stops sending, what it runs finishes, it exits) and is started again on its port. No request
    fails, none gets a 5xx, and every restarted worker is back in rotation."""
    stop = threading.Event()
    statuses: list[int] = []
    failures: list[str] = []

    def steady(i: int) -> None:
        n = 0
        while not stop.is_set():
            r = httpx.post(f"{fleet.url}/generate", json={"text": f"Client {i} asks question {n}: why?",
                                                          "sampling_params": {"max_new_tokens": 4}}, timeout=120)
            statuses.append(r.status_code)
            if r.status_code != 200:
                failures.append(f"{r.status_code} {r.text[:200]}")
            n += 1

    with ThreadPoolExecutor(2) as pool:
        clients = [pool.submit(steady, i) for i in range(2)]
        time.sleep(1.0)
        for port in fleet.worker_ports:
            info = httpx.get(f"http://127.0.0.1:{port}/get_server_info", timeout=10).json()
            http_pid = info["pids"]["http"]  # the worker's own process (its children stop with it)
            mine = next((p for p in fleet.extra if p.pid == http_pid), None)
            os.kill(http_pid, signal.SIGTERM)
            deadline = time.monotonic() + 60
            while pid_alive(http_pid):
                assert time.monotonic() < deadline, f"the worker on :{port} did not drain and exit"
                time.sleep(0.1)
            if mine is not None:  # one this test started: its exit code is ours to read
                assert mine.wait(10) == 0
            _start_worker(fleet, port)
        stop.set()
        for c in clients:
            c.result()
    assert statuses and set(statuses) == {200}, failures
    urls = [f"http://127.0.0.1:{p}" for p in fleet.worker_ports]
    before = [_sent_to(fleet, u) for u in urls]
    hits = [httpx.post(f"{fleet.url}/generate", json={"text": f"fresh prompt number {i} " * 3,
                                                      "sampling_params": {"max_new_tokens": 1}}, timeout=60)
            for i in range(6)]
    assert all(h.status_code == 200 for h in hits)
    assert sum(_sent_to(fleet, u) for u in urls) == sum(before) + 6
    # back in rotation: with --health-failure-threshold 1 one slow probe of a worker that has just
    # started takes it out until the next probe, so this waits out a few probe intervals
    deadline = time.monotonic() + 10 * HEALTH_INTERVAL_S
    while not (len(fleet.workers()) == 3 and all(w["healthy"] and w["eligible"] for w in fleet.workers())):
        assert time.monotonic() < deadline, fleet.workers()
        time.sleep(0.25)


def test_a_worker_killed_under_load_is_ejected_and_nothing_is_lost(fleet: LaunchedFleet) -> None:
    victim_port = fleet.worker_ports[1]
    victim = f"http://127.0.0.1:{victim_port}"
    pids = fleet.worker_pids(victim_port)

    def one(i: int) -> int:
        r = httpx.post(f"{fleet.url}/generate", json={"text": f"Count from {i} to {i + 40}:",
                                                      "sampling_params": {"max_new_tokens": 24}}, timeout=120)
        return r.status_code

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, i) for i in range(8)]
        time.sleep(1.5)  # requests are running on both workers now
        for pid in pids:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        while time.monotonic() - killed < HEALTH_INTERVAL_S + 1.0:
            if not next(w for w in fleet.workers() if w["url"] == victim)["healthy"]:
                break
            time.sleep(0.05)
        ejected_after = time.monotonic() - killed
        statuses = [f.result() for f in futures]
    assert ejected_after <= HEALTH_INTERVAL_S + 0.5, ejected_after
    assert statuses == [200] * 8  # every accepted request finished, on the survivor where need be
    survivor = f"http://127.0.0.1:{fleet.worker_ports[0]}"
    with httpx.Client(base_url=survivor, timeout=30) as c:
        assert_memory_ok(wait_idle(c))

