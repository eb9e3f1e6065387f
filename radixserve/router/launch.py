"""``radixserve launch``: a fleet on one machine, N workers and a router, from one command.

    radixserve launch --num-workers 2 --port 30000 [engine options] [router options]

Workers listen on the ports after the router's (``--port`` + 1 ... + N), each a ``radixserve serve``
process with its share of the CPU threads (``--num-threads``, default: the cores divided by N and
by ``--dp-size``, at least 1). With ``--cache-events-port P`` worker i publishes on
P + i * dp_size (and up). Their schedulers are forked by one zygote process that has imported torch
and the model code once for all of them (``radixserve/server/zygote.py``). The router waits for the
workers, then serves. Ctrl-C (or SIGTERM) stops the router, then the workers (SIGTERM, then SIGKILL
after ``STOP_TIMEOUT_S``), then the zygote. If a worker fails to start, the fleet is stopped and the
command exits 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from radixserve.config import ServerArgs
from radixserve.config.serving import SCHEDULER_ZYGOTE_ENV
from radixserve.router.config import RouterArgs

logger = logging.getLogger("radixserve.launch")
STOP_TIMEOUT_S = 15.0
SHARED = ("host", "port", "api_key", "log_level")  # options the router and the workers both take


def add_launch_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-workers", type=int, default=2, help="Workers to start (default: 2).")
    ServerArgs.add_cli_args(p)
    # an option both take (--enable-priority-scheduling, --tenant-weights, ...) is given once and
    # applies to the workers and to the router's queue alike
    both = {f.name for f in dataclasses.fields(ServerArgs)} & {f.name for f in dataclasses.fields(RouterArgs)}
    RouterArgs.add_cli_args(p, skip=(*SHARED, *sorted(both), "worker_urls"))


def worker_command(args: ServerArgs, port: int, threads: int) -> list[str]:
    """``radixserve serve`` with every engine option that differs from its default."""
    cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--port", str(port)]
    for f in dataclasses.fields(ServerArgs):
        v = getattr(args, f.name)
        if f.name == "port" or v == f.default or v is None:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(v, bool):
            cmd.append(flag if v else "--no-" + flag[2:])  # differs from the default: on, or off
            continue
        cmd += [flag, str(v)]
    if args.num_threads is None:
        cmd += ["--num-threads", str(threads)]
    return cmd


def fleet_args(ns: argparse.Namespace) -> tuple[ServerArgs, RouterArgs]:
    """The workers' options and the router's (its workers on the ports after its own)."""
    sargs = ServerArgs.from_cli_args(ns)
    rkw = {f.name: getattr(ns, f.name) for f in dataclasses.fields(RouterArgs)
           if f.name not in (*SHARED, "worker_urls") and getattr(ns, f.name, None) is not None}
    if ns.num_workers < 1:
        raise ValueError("--num-workers must be >= 1")
    ports = [sargs.port + 1 + i for i in range(ns.num_workers)]
    rargs = RouterArgs(worker_urls=tuple(f"http://127.0.0.1:{p}" for p in ports), host=sargs.host,
                       port=sargs.port, api_key=sargs.api_key, log_level=sargs.log_level, **rkw)
    return sargs, rargs


def launch_fleet(ns: argparse.Namespace) -> int:
    logging.basicConfig(level=(ns.log_level or "info").upper(), format="[%(asctime)s %(name)s] %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per start-up poll otherwise
    try:
        sargs, rargs = fleet_args(ns)
    except ValueError as e:
        logger.error("%s", e)
        return 2
    n = len(rargs.worker_urls)
    ports = [sargs.port + 1 + i for i in range(n)]
    threads = max(1, (os.cpu_count() or 1) // (n * sargs.dp_size))
    procs: list[subprocess.Popen[bytes]] = []
    zygote_dir = tempfile.mkdtemp(prefix="radixserve-zygote-")
    try:
        # one process imports torch and the model code once and forks every worker's schedulers
        # (server/zygote.py); the workers find it through the environment
        socket_path = os.path.join(zygote_dir, "zygote")
        procs.append(subprocess.Popen([sys.executable, "-m", "radixserve.server.zygote", socket_path,
                                       str(os.getpid())]))
        env = {**os.environ, SCHEDULER_ZYGOTE_ENV: socket_path}
        for p in ports:
            wargs = sargs.replace(host="127.0.0.1")
            if sargs.cache_events_port is not None:  # one publisher port per rank of each worker
                wargs = wargs.replace(cache_events_port=sargs.cache_events_port + (p - ports[0]) * sargs.dp_size)
            cmd = worker_command(wargs, p, threads)
            logger.info("worker on :%d: %s", p, " ".join(masked(cmd[2:])))
            # NOTE: their own process group, so a terminal's Ctrl-C reaches the router alone and the
            # workers are stopped in order by us.
            procs.append(subprocess.Popen(cmd, start_new_session=True, env=env))
        # the router's modules load while the workers start (they are most of its own start-up)
        from radixserve.router.app import run_router

        if not _wait_started(procs[1:], rargs):
            return 1
        return run_router(rargs)
    finally:
        _stop(procs[1:])
        _stop(procs[:1])
        shutil.rmtree(zygote_dir, ignore_errors=True)


def masked(cmd: list[str]) -> list[str]:
    """The command as logged: keys replaced by ***."""
    return ["***" if i and cmd[i - 1] in ("--api-key", "--admin-api-key") else a for i, a in enumerate(cmd)]


def _wait_started(procs: list[subprocess.Popen[bytes]], rargs: RouterArgs) -> bool:
    """Wait until every worker answers /health (False, logged, if one exits or the startup timeout
    passes). The router follows a healthy worker within one poll."""
    try:
        wait_healthy(dict(zip(rargs.worker_urls, procs, strict=True)), rargs.worker_startup_timeout_secs)
    except StartFailed as e:
        logger.error("%s", e)
        return False
    return True


class StartFailed(Exception):
    """A server started for a fleet or a benchmark exited, or was not healthy in time."""

    def __init__(self, url: str, why: str) -> None:
        super().__init__(f"{url} {why}")
        self.url = url


def wait_healthy(pending: dict[str, subprocess.Popen[Any]], timeout: float, interval: float = 0.05) -> None:
    """Poll each server's ``/health`` (its base URL -> its process) until all answer 200; raises
    ``StartFailed`` when a process exits first or ``timeout`` seconds pass. One HTTP client for all
    polls: a fresh one per poll (``httpx.get``) costs ~50 ms of CPU (its TLS context), half a core
    at 10 polls a second, taken from the servers it waits for."""
    import httpx

    deadline = time.monotonic() + timeout
    pending = dict(pending)
    with httpx.Client(timeout=2) as client:
        while pending:
            for url, proc in list(pending.items()):
                if proc.poll() is not None:
                    raise StartFailed(url, f"exited with {proc.returncode} while starting")
                try:
                    if client.get(f"{url}/health").status_code == 200:
                        del pending[url]
                except httpx.HTTPError:
                    pass
            if not pending:
                return
            if time.monotonic() > deadline:
                raise StartFailed(", ".join(pending), f"not healthy after {timeout:.0f} s")
            time.sleep(interval)


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)
