"""The server a reliability benchmark (``bench fuzz``, ``bench soak``) runs against: one it starts
(a real ``radixserve serve`` in its own session, its output in a temporary log) or one already
running at ``--base-url``; and the checks both benchmarks end with.

``healthy_after`` is the verdict on the server after the run: ``/health`` answers 200, a real
generation completes, and once idle the KV pool and the request slots are all free again
(``/debug/memory``: nothing protected, ``available + evictable == total``, every request slot
free, the pool's invariant holds). ``rss_mb`` reads the resident memory of the server's
processes (HTTP, scheduler, detokenizer: ``/get_server_info``'s ``pids``) from ``/proc``, so it
works only for a server on this machine.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx

from radixserve.bench.subprocs import BenchError, free_ports

STARTUP_TIMEOUT_S = 600.0
IDLE_TIMEOUT_S = 60.0


def add_target_args(p: argparse.ArgumentParser, default_server_args: str) -> None:
    p.add_argument("--base-url", default=None,
                   help="Run against this server (no /v1) instead of starting one. RSS figures need it to run "
                        "on this machine.")
    p.add_argument("--api-key", default=None, help="Sent as 'Authorization: Bearer <key>'.")
    p.add_argument("--server-args", default=default_server_args,
                   help="Without --base-url: the options of the 'radixserve serve' this command starts (on a "
                        "free port; --port and --host are set here).")


class Target:
    """The server under test: started here (``stop`` ends it) or given by URL."""

    def __init__(self, ns: argparse.Namespace) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path: str | None = None
        self.headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
        if ns.base_url:
            self.url = ns.base_url.rstrip("/")
        else:
            port = free_ports(1)[0]
            self.url = f"http://127.0.0.1:{port}"
            fd, self.log_path = tempfile.mkstemp(prefix="radixserve-bench-server-", suffix=".log")
            cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                   *shlex.split(ns.server_args)]
            if ns.api_key:
                cmd += ["--api-key", ns.api_key]
            print(f"starting: {shlex.join(cmd[1:])}  (log: {self.log_path})", flush=True)
            self.proc = subprocess.Popen(cmd, stdout=fd, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
            os.close(fd)
        self.client = httpx.Client(base_url=self.url, headers=self.headers, timeout=60)
        self.pids: dict[str, int] = {}

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise BenchError(f"the server exited with {self.proc.returncode} while starting:\n{self.log_tail()}")
            try:
                if self.client.get("/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise BenchError(f"the server at {self.url} is not healthy after {STARTUP_TIMEOUT_S:.0f} s\n"
                                 f"{self.log_tail()}")
            time.sleep(0.25)
        info = self.client.get("/get_server_info").json()
        self.pids = {k: int(v) for k, v in (info.get("pids") or {}).items()}
        model = self.client.get("/get_model_info").json()
        self.context_len = int(model["context_length"])
        self.vocab_size = int(model.get("vocab_size") or 32000)

    def log_tail(self, n: int = 3000) -> str:
        if self.log_path is None:
            return ""
        with open(self.log_path, "rb") as f:
            return f.read()[-n:].decode(errors="replace")

    def stop(self) -> None:
        self.client.close()
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the server stops its processes
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def alive(self) -> bool:
        return self.proc is None or self.proc.poll() is None

    def rss_mb(self) -> dict[str, float] | None:
        """Resident memory of each server process in MiB, or None where /proc does not show them."""
        out: dict[str, float] = {}
        for name, pid in sorted(self.pids.items()):
            try:
                with open(f"/proc/{pid}/status") as f:
                    kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
            except (OSError, StopIteration):
                return None
            out[name] = kb / 1024
        return out or None

    def wait_idle(self, timeout: float = IDLE_TIMEOUT_S) -> dict[str, Any]:
        """``/debug/memory`` once nothing runs or waits (or the last answer after ``timeout``)."""
        deadline = time.monotonic() + timeout
        while True:
            mem: dict[str, Any] = self.client.get("/debug/memory").json()
            if mem.get("idle") or time.monotonic() > deadline:
                return mem
            time.sleep(0.1)

    def healthy_after(self) -> dict[str, Any]:
        """The checks after a run; ``ok`` is their conjunction, ``problems`` says what failed."""
        problems: list[str] = []
        out: dict[str, Any] = {}
        try:
            out["health"] = self.client.get("/health", timeout=10).status_code
            if out["health"] != 200:
                problems.append(f"/health answered {out['health']}")
            r = self.client.post("/generate", json={"text": "The capital of France is",
                                                    "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
            gen = r.json() if r.status_code == 200 else {}
            out["generation"] = {"status": r.status_code, "text": gen.get("text"),
                                 "completion_tokens": (gen.get("meta_info") or {}).get("completion_tokens")}
            if r.status_code != 200 or not gen.get("output_ids"):
                problems.append(f"a real generation failed: {r.status_code} {r.text[:200]}")
            mem = self.wait_idle()
            out["memory"] = {k: mem.get(k) for k in ("total", "available", "evictable", "protected",
                                                     "req_slots_free", "req_slots_total", "idle", "invariant_ok")}
            problems += memory_problems(mem)
        except httpx.HTTPError as e:
            problems.append(f"the server did not answer: {e!r}")
        if not self.alive():
            problems.append(f"the server process exited ({self.proc.returncode if self.proc else '?'})")
        out["problems"] = problems
        out["ok"] = not problems
        return out


def memory_problems(mem: dict[str, Any]) -> list[str]:
    """What is wrong with an idle server's pools: a leaked KV slot or request slot, a broken invariant."""
    problems = []
    if not mem.get("idle"):
        problems.append(f"not idle after {IDLE_TIMEOUT_S:.0f} s")
        return problems
    leaked_kv = mem["total"] - mem["available"] - mem["evictable"]
    if leaked_kv or mem["protected"]:
        problems.append(f"KV slots leaked: {leaked_kv} (protected {mem['protected']})")
    if mem["req_slots_free"] != mem["req_slots_total"]:
        problems.append(f"request slots leaked: {mem['req_slots_total'] - mem['req_slots_free']}")
    if mem.get("invariant_ok") is False:
        problems.append(f"the pool's invariant fails: {mem.get('invariant_error')}")
    return problems
