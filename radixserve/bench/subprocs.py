"""The processes a benchmark starts (stub workers, routers, fleets): start, log, stop, pin, time.

Each runs in its own session with its output in a temporary log, so a benchmark can show a
failing process's last lines and stop everything it started on the way out.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import resource
import signal
import socket
import subprocess
import tempfile
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import aiohttp

CLK_TCK = os.sysconf("SC_CLK_TCK")
STOP_S = 10.0
LAUNCH_STOP_S = 60.0  # launch stops its router, then each worker (15 s grace each)


class BenchError(RuntimeError):
    """A benchmark cannot go on (a process failed to start, no free port): said in one line."""

class Procs:
    """The subprocesses of one benchmark, each in a session of its own (so a terminal's Ctrl-C
    reaches this process alone and they are stopped in order here), with its output in a log file."""

    def __init__(self) -> None:
        self.log_dir = tempfile.mkdtemp(prefix="radixserve-bench-router-")
        self.running: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, cmd: list[str]) -> subprocess.Popen[bytes]:
        log = open(os.path.join(self.log_dir, re.sub(r"[^\w.-]", "_", name) + ".log"), "ab")
        try:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        finally:
            log.close()
        self.running.append((name, proc))
        return proc

    def log_tail(self, name: str, n: int = 2000) -> str:
        path = os.path.join(self.log_dir, re.sub(r"[^\w.-]", "_", name) + ".log")
        try:
            with open(path, "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self, proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = STOP_S) -> None:
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        self.running = [(n, p) for n, p in self.running if p is not proc]

    def stop_all(self) -> None:
        for name, proc in reversed(list(self.running)):
            # launch stops its workers on SIGINT (KeyboardInterrupt while starting, or its router's handler)
            if name.startswith("launch"):
                self.stop(proc, signal.SIGINT, LAUNCH_STOP_S)
            else:
                self.stop(proc)


def stop_group(proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    """SIGTERM to a server started in a session of its own, and to every process in its group; then
    SIGKILL to the group if it has not exited after ``timeout`` seconds."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def free_ports(n: int, consecutive: bool = False) -> list[int]:
    """``n`` ports nothing listens on now (``consecutive``: a block, as ``radixserve launch`` wants)."""
    if not consecutive:
        socks = [socket.socket() for _ in range(n)]
        try:
            for s in socks:
                s.bind(("127.0.0.1", 0))
            return [s.getsockname()[1] for s in socks]
        finally:
            for s in socks:
                s.close()
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 60000 - n)
        if all(port_free(base + i) for i in range(n)):
            return list(range(base, base + n))
    raise BenchError(f"found no {n} free consecutive ports")


def port_free(port: int) -> bool:
    """Whether a socket can bind ``port`` on 127.0.0.1 now."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads (``/proc/<pid>/stat`` fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def self_cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` (threads started later inherit their creator's affinity)."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:
        return
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except (ProcessLookupError, PermissionError):
            pass


async def wait_healthy(session: aiohttp.ClientSession, url: str, proc: subprocess.Popen[bytes], name: str,
                       procs: Procs, timeout: float) -> None:
    import aiohttp

    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise BenchError(f"{name} exited with {proc.returncode} while starting:\n{procs.log_tail(name)}")
        try:
            async with session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                if r.status == 200:
                    return
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass
        if time.monotonic() > deadline:
            raise BenchError(f"{name} not healthy after {timeout:.0f} s:\n{procs.log_tail(name)}")
        await asyncio.sleep(0.1)
