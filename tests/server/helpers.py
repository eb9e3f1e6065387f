"""A real ``radixserve serve`` process for the server tests, and checks on it."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from radixserve.bench.subprocs import port_free
from radixserve.config import ServerArgs
from radixserve.router.launch import StartFailed, wait_healthy
from radixserve.server.frontend.recent_requests import RecentRequests
from radixserve.server.scheduler.dashboard_state import rank_snapshot
from tests.fakes import make_scheduler

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STARTUP_TIMEOUT_S = 240.0
API_KEY = "sk-radixserve-test"


_issued: set[int] = set()  # ports handed out in this test process, and the port after each


def _ephemeral_floor() -> int:
    """The lowest port the kernel picks by itself (a bind to port 0, an outgoing connection's source
    port); Linux's default where its setting cannot be read."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port that, with the port after it (a prefill worker's data-parallel ranks take the ports
    after its base), nothing uses now and this process has not handed out yet. Drawn below the
    kernel's ephemeral range: a port drawn from it (a bind to port 0) and left closed until a server
    binds it could meanwhile become the source port of one of the many short connections the tests
    make (an address-in-use failure seen in CI); below it, only a server naming it can take it."""
    floor = _ephemeral_floor()
    for _ in range(1000 if floor > 10_002 else 0):
        port = random.randrange(10_000, floor - 1)
        if not {port, port + 1} & _issued and port_free(port) and port_free(port + 1):
            _issued.update((port, port + 1))
            return port
    while True:  # no room below the ephemeral range: let the kernel pick
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if not {port, port + 1} & _issued:
            _issued.update((port, port + 1))
            return port


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


class ServerProcess:
    def __init__(self, *extra: str, api_key: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log = tempfile.NamedTemporaryFile(prefix="radixserve-test-server-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--port", str(self.port),
               "--max-total-tokens", "8192", "--decode-log-interval", "20", *extra]
        if api_key:
            cmd += ["--api-key", api_key]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # NOTE: its own session, so a Ctrl-C can be sent to its process group like a terminal does
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self.pids: dict[str, int] = {}

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def wait_ready(self) -> None:
        try:
            wait_healthy({self.url: self.proc}, STARTUP_TIMEOUT_S)
        except StartFailed as e:
            self.kill()
            raise RuntimeError(f"{e}:\n{self.log_text()[-4000:]}") from None
        info = httpx.get(f"{self.url}/get_server_info", headers=self.headers, timeout=10).json()
        self.pids = info["pids"]

    def log_text(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def client(self, **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=60, **kw)

    def children(self) -> list[int]:
        return [self.pids[k] for k in ("scheduler", "detokenizer") if k in self.pids]

    def interrupt(self, timeout: float = 30.0) -> int:
        """Ctrl-C as a terminal sends it: SIGINT to the whole process group."""
        os.killpg(self.proc.pid, signal.SIGINT)
        return self.proc.wait(timeout)

    def drain(self, timeout: float = 60.0) -> int:
        """SIGTERM while a request runs, as an orchestrator stops a worker: the server drains (health
        and new requests 503 ``server_draining``), the running request finishes whole, then it exits;
        returns the exit code."""
        tokens = 40
        with ThreadPoolExecutor(1) as pool, self.client() as c:
            long = pool.submit(c.post, "/generate", json={"text": "Count to a hundred:", "sampling_params": {
                "max_new_tokens": tokens, "ignore_eos": True, "temperature": 0}})
            deadline = time.monotonic() + 30
            while c.get("/get_load").json()[0]["num_reqs"] == 0:  # running
                assert time.monotonic() < deadline and not long.done(), "the request never started"
                time.sleep(0.02)
            self.proc.send_signal(signal.SIGTERM)
            while c.get("/health").status_code == 200:
                assert time.monotonic() < deadline, "/health never said draining"
                time.sleep(0.02)
            health = c.get("/health")
            assert health.status_code == 503 and health.json()["error"]["code"] == "server_draining", health.text
            refused = c.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1}})
            assert refused.status_code == 503 and refused.headers.get("Retry-After") == "1", refused.text
            assert refused.json()["error"]["code"] == "server_draining"
            done = long.result(timeout)
        assert done.status_code == 200 and done.json()["meta_info"]["completion_tokens"] == tokens, done.text
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)
        for pid in self.children():
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


def started(srv: ServerProcess) -> Iterator[ServerProcess]:
    """A fixture's body: wait for ``srv``, hand it over, kill it and drop its log afterwards."""
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.kill()
        os.unlink(srv.log.name)


def wait_idle(client: httpx.Client, timeout: float = 30.0) -> dict[str, Any]:
    """Wait until no request is running or waiting; return /debug/memory then."""
    deadline = time.monotonic() + timeout
    while True:
        load = client.get("/get_load").json()[0]
        if load["num_reqs"] == 0:
            mem = client.get("/debug/memory").json()
            if mem["idle"]:
                return mem
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle after {timeout}s: {load}")
        time.sleep(0.05)


def assert_memory_ok(mem: dict[str, Any]) -> None:
    assert mem["idle"] and mem["invariant_ok"], mem
    assert mem["protected"] == 0
    assert mem["available"] + mem["evictable"] == mem["total"]
    assert mem["req_slots_free"] == mem["req_slots_total"]


def fake_dashboard_tm(api_key: str | None) -> Any:
    """Enough of a ``TokenizerManager`` for ``create_app`` to serve ``/health``, ``/get_load`` and the
    dashboard in-process: ``control("dashboard")`` snapshots an idle echo-runner scheduler."""
    from types import SimpleNamespace

    sched, _, _ = make_scheduler()

    async def control(op: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        if op == "dashboard":
            return [rank_snapshot(sched)]
        if op == "get_load":
            return [{"dp_rank": 0, **sched.get_load()}]
        return [{}]  # what a router asks at start-up (server info, memory): nothing it needs

    return SimpleNamespace(args=ServerArgs(api_key=api_key), tokenizer=None, model_name="fake", dp_size=1,
                           control=control, recent_requests=RecentRequests(), alive=lambda: True, info={})


def post_disaggregated(prefill_url: str, decode_url: str, body: dict[str, Any], timeout: float = 120) -> httpx.Response:
    """One request through a prefill/decode pair, as a router sends it: the same body (with its
    bootstrap fields) to both at once. Asserts the prefill side's answer; returns the decode side's."""
    with ThreadPoolExecutor(2) as pool:
        fp = pool.submit(httpx.post, prefill_url + "/generate", json=body, timeout=timeout)
        fd = pool.submit(httpx.post, decode_url + "/generate", json=body, timeout=timeout)
        assert fp.result().status_code == 200, fp.result().text
        return fd.result()
