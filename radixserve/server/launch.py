"""``launch_server``: start the scheduler and detokenizer processes, wait for them, serve HTTP.

    radixserve serve [--model-path P] [--host H] [--port N] [every engine option]

Exit codes: 0 after Ctrl-C / SIGTERM (everything shut down in order), 1 when a child process
died (``/health`` answers 503 first, for ``FATAL_EXIT_DELAY_S``) or failed to start, 130 when
interrupted while loading. Shutdown never hangs: children get SIGTERM, then SIGKILL, and a timer
kills the whole server if a graceful shutdown takes longer than ``HARD_EXIT_S``.

With ``--tp-size N`` the scheduler process is tensor-parallel rank 0 and ranks 1..N-1 are children
``tp_1``...; with ``--nnodes K``, ``--node-rank 0`` runs all that for its N/K ranks and any other
node rank only starts its N/K ranks (``launch_tp_node``), which exit when rank 0 does.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import types
from collections.abc import Callable, Generator
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any, cast

from tqdm import tqdm

from radixserve.config import ServerArgs
from radixserve.config.serving import SCHEDULER_ZYGOTE_ENV as ZYGOTE_ENV
from radixserve.model.loader import load_config, resolve_model_path
from radixserve.server.procs import IpcNames, run_entry, setup_logging
from radixserve.server.zygote import ZygoteChild

if TYPE_CHECKING:
    import uvicorn

    from radixserve.server.frontend.tokenizer_manager import TokenizerManager

# NOTE: the HTTP side (FastAPI, uvicorn, the tokenizer manager: ~1 s of imports) is imported after the
# children are started, so the scheduler's own imports and model load, the long pole of start-up,
# begin at once.

logger = logging.getLogger(__name__)

FATAL_EXIT_DELAY_S = 1.0  # /health says 503 this long before the server exits
HARD_EXIT_S = 10.0
LOAD_STAGES = 6  # tokenizer, 3 scheduler stages, scheduler ready, detokenizer ready


def _http_server(config: uvicorn.Config) -> uvicorn.Server:
    """uvicorn without its own signal handling: ``launch_server`` owns SIGINT/SIGTERM."""
    import uvicorn

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Generator[None, None, None]:
            yield

    return _Server(config)


def served_model_name(args: ServerArgs) -> tuple[str, str]:
    """(name, resolved path): --served-model-name, else the file or directory name."""
    _, path = resolve_model_path(args.model_path)
    if args.served_model_name:
        return args.served_model_name, path
    name = os.path.basename(os.path.normpath(path))
    return name.removesuffix(".gguf"), path


class _CannotStart(Exception):
    """The model cannot be served (an unreadable file, an unknown architecture): one line, exit 1."""


def launch_server(args: ServerArgs) -> int:
    setup_logging(args.log_level, "HTTP" if args.node_rank == 0 else f"node{args.node_rank}")
    try:
        if args.tp_size > 1:
            args = _tp_args(args)
        if args.node_rank > 0:
            return launch_tp_node(args)
        _check_port(args.host, args.port)  # fail before the model loads, not after
        served_model_name(args)
    except (OSError, ValueError, NotImplementedError) as e:
        logger.error("cannot start: %s", e)
        return 1
    ipc = IpcNames.new()
    procs: dict[str, BaseProcess] = {}
    try:
        return asyncio.run(_serve(args, ipc, procs))
    except _CannotStart as e:
        logger.error("cannot start: %s", e)
        return 1
    except KeyboardInterrupt:
        logger.info("interrupted while starting")
        return 130
    except RuntimeError as e:
        logger.error("%s", e)
        return 1
    finally:
        shutdown_children(procs)
        ipc.cleanup()


def _tp_args(args: ServerArgs) -> ServerArgs:
    """Refuse a tp size the model's heads do not allow before anything starts, and fill in the
    store address and each rank's threads."""
    from radixserve.model.loader import load_config
    from radixserve.model.parallel import check_tp_size
    from radixserve.model.tp_worker import with_tp_defaults

    check_tp_size(load_config(args.model_path), args.tp_size)
    return with_tp_defaults(args)


def _tp_ranks(args: ServerArgs, parent: int, ipc: IpcNames | None) -> list[tuple[str, Any, tuple[Any, ...]]]:
    """This node's tensor-parallel ranks but rank 0 (the scheduler process, on node 0)."""
    run_tp_worker_process = functools.partial(run_entry, "radixserve.server.scheduler.tp_worker_proc:run_tp_worker_process")
    per_node = args.tp_ranks_per_node
    first = args.node_rank * per_node
    return [(f"tp_{r}", run_tp_worker_process, (args, ipc, parent, r))
            for r in range(max(first, 1), first + per_node)]


def launch_tp_node(args: ServerArgs) -> int:
    """``--node-rank k > 0``: run this node's tensor-parallel ranks until they exit. 0 when they
    all exited cleanly (rank 0 stopped), 1 when one failed, 0 after Ctrl-C / SIGTERM."""
    ctx = mp.get_context("spawn")
    procs: dict[str, BaseProcess] = {}
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    logger.info("node %d of %d: starting tensor-parallel ranks %s (rank 0's store at %s)", args.node_rank,
                args.nnodes, [n for n, _, _ in _tp_ranks(args, 0, None)], args.dist_init_addr)
    try:
        for pname, target, pargs in _tp_ranks(args, os.getpid(), None):
            procs[pname] = _start(ctx, pname, target, pargs)
        while not stop.is_set() and any(p.is_alive() for p in procs.values()):
            stop.wait(0.2)
    finally:
        shutdown_children(procs)
    failed = {n: p.exitcode for n, p in procs.items() if p.exitcode not in (0, -signal.SIGTERM)}
    if failed and not stop.is_set():
        logger.error("tensor-parallel ranks failed: %s", failed)
        return 1
    logger.info("node %d: tensor-parallel ranks stopped", args.node_rank)
    return 0


def _check_port(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise OSError(f"cannot bind {host}:{port}: {e.strerror}") from None


def shutdown_children(procs: dict[str, BaseProcess], timeout: float = 5.0) -> None:
    for p in procs.values():
        if p.is_alive():
            p.terminate()
    for p in procs.values():
        p.join(timeout)
        if p.is_alive():
            p.kill()
            p.join(1.0)


class _Shutdown:
    """How the HTTP process ends: a first SIGINT/SIGTERM drains (no new requests, ``/health`` 503,
    the ones in flight finish within ``grace`` seconds) and then stops uvicorn gracefully, a second
    stops it at once; a dead child process (``on_fatal``) stops it after a short delay, and exits hard
    if that hangs."""

    def __init__(self, procs: dict[str, BaseProcess], loop: asyncio.AbstractEventLoop, grace: float) -> None:
        self.procs = procs
        self.loop = loop
        self.grace = grace
        self.server: uvicorn.Server | None = None
        self.tm: TokenizerManager | None = None
        self.interrupted = False
        self.exit_code = 0
        self._drain: asyncio.Task[None] | None = None

    def on_signal(self) -> None:
        first = not self.interrupted
        self.interrupted = True
        if self.server is None:
            return
        if first and self.grace > 0 and self.tm is not None:
            self.tm.draining = True
            self._drain = self.loop.create_task(self._drain_then_stop(self.tm, self.server))
            return
        if self.server.should_exit:
            self.server.force_exit = True
        self.server.should_exit = True

    async def _drain_then_stop(self, tm: TokenizerManager, server: uvicorn.Server) -> None:
        deadline = self.loop.time() + self.grace
        if tm.groups:
            logger.info("draining: %d request(s) in flight, up to %.0f s (a second Ctrl-C exits at once)",
                        len(tm.groups), self.grace)
        while tm.groups and self.loop.time() < deadline and not server.should_exit:
            await asyncio.sleep(0.05)
        if tm.groups:
            logger.warning("draining: %d request(s) still in flight after %.0f s; stopping", len(tm.groups),
                           self.grace)
        server.should_exit = True

    def on_fatal(self, reason: str) -> None:
        self.exit_code = 1
        server = self.server

        def stop() -> None:
            if server is not None:
                server.should_exit = True

        self.loop.call_later(FATAL_EXIT_DELAY_S, stop)
        timer = threading.Timer(FATAL_EXIT_DELAY_S + HARD_EXIT_S, _hard_exit, (self.procs,))
        timer.daemon = True
        timer.start()


async def _serve(args: ServerArgs, ipc: IpcNames, procs: dict[str, BaseProcess]) -> int:
    loop = asyncio.get_running_loop()
    end = _Shutdown(procs, loop, args.shutdown_grace_period_secs)
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, end.on_signal)
    name, model_path = served_model_name(args)
    tm, app = await _start_processes(args, ipc, procs, name, model_path, lambda: end.interrupted)
    import uvicorn

    # NOTE: h11 always, not httptools when it happens to be installed: how an HTTP/2 preface is
    # parsed (and so refused, see server/frontend/guard.py) must not depend on the environment
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            access_log=args.log_level == "debug", timeout_graceful_shutdown=3,
                            timeout_keep_alive=5, http="h11")
    server = end.server = _http_server(config)
    end.tm = tm
    tm.on_fatal = end.on_fatal
    tm.start()
    info = tm.info
    logger.info(
        "serving %s on http://%s:%d (context %d, KV pool %d tokens, dtype %s)",
        name, args.host, args.port, info["context_len"], info["max_total_num_tokens"], info.get("dtype"),
    )
    try:
        await server.serve()
    finally:
        await tm.stop()
    if end.exit_code:
        logger.error("exiting: %s", tm.dead)
    elif end.interrupted:
        logger.info("shut down")
    return end.exit_code


async def _start_processes(args: ServerArgs, ipc: IpcNames, procs: dict[str, BaseProcess], name: str,
                           model_path: str, interrupted: Callable[[], bool]) -> tuple[TokenizerManager, Any]:
    """Start the child processes, load the tokenizer and build the HTTP app meanwhile, and wait
    until every child is ready, with a progress bar of the loading stages."""
    ctx = mp.get_context("spawn")
    tqdm.set_lock(threading.RLock())  # NOTE: tqdm's default lock is a multiprocessing semaphore
    stages = LOAD_STAGES if args.dp_size == 1 else LOAD_STAGES + 4 * (args.dp_size - 1) + 1
    stages += args.tp_ranks_per_node - 1  # each tp_<r> child's "ready"
    # every stage is written, even two that arrive within tqdm's default 0.1 s of each other
    bar = tqdm(total=stages, desc=f"Loading {name}", unit="stage", mininterval=0, miniters=1,
               bar_format="{desc}: {percentage:3.0f}%|{bar}| {n}/{total} [{elapsed}] {postfix}")
    interactive = sys.stderr.isatty()

    def progress(stage: str) -> None:
        if stage:
            bar.set_postfix_str(stage, refresh=False)
            bar.update(1)
        elif interactive:  # the elapsed-time tick; in a log file it would only repeat the line
            bar.refresh()

    try:
        # The schedulers first: loading the model is the long pole. They start before the model
        # file is checked (their first second is importing torch; a file that cannot be served
        # stops them before they read it). This process's imports and tokenizer load run
        # meanwhile, and only then the detokenizer (given this tokenizer): with two cores, the
        # schedulers keep one to themselves rather than share two with both of these.
        # The children's sockets connect to the tokenizer manager's once it binds (zmq retries
        # within 100 ms, and queues what they send).
        parent = os.getpid()
        children = _children(args, ipc, parent)
        for pname, target, pargs in children:
            if pname != "detokenizer":
                procs[pname] = _start(ctx, pname, target, pargs)
        try:  # an unreadable file or an unknown architecture: one line
            await asyncio.to_thread(load_config, args.model_path)
        except (OSError, ValueError, NotImplementedError) as e:
            raise _CannotStart(str(e)) from e
        from radixserve.model.tokenizer import Tokenizer
        from radixserve.server.frontend.tokenizer_manager import TokenizerManager

        tm = TokenizerManager(args, ipc, name)
        from radixserve.server.frontend.http_server import create_app, pid_map  # FastAPI: ~0.4 s
        tokenizer = await asyncio.to_thread(
            lambda: Tokenizer.from_model_path(args.model_path).use_chat_template(args.chat_template)
        )
        progress("tokenizer loaded")
        for pname, target, pargs in children:
            if pname == "detokenizer":
                procs[pname] = _start(ctx, pname, target, (*pargs, tokenizer))
        tm.tokenizer = tokenizer
        app = create_app(tm, model_path, pid_map(procs))
        await tm.wait_ready(procs, progress, interrupted)
    finally:
        bar.close()
    return tm, app


def _start(ctx: Any, pname: str, target: Any, pargs: tuple[Any, ...]) -> BaseProcess:
    """Start one child. A scheduler comes from the zygote that ``radixserve launch`` runs for its
    workers (``zygote.py``) when there is one. "spawn" runs the parent's ``__main__`` again in
    every child (for radixserve, the console script and so the command line's imports, ~50 ms) so
    that targets defined there can be found; ours are ``run_entry`` partials named by module, so
    the children are started with a bare ``__main__`` in its place."""
    zygote = os.environ.get(ZYGOTE_ENV)
    if zygote and pname.startswith("scheduler"):
        return cast(BaseProcess, ZygoteChild(zygote, pname, target, pargs))
    p = ctx.Process(target=target, args=pargs, name=f"radixserve-{pname}", daemon=True)
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        p.start()
    finally:
        sys.modules["__main__"] = main
    return p


def _children(args: ServerArgs, ipc: IpcNames, parent: int) -> list[tuple[str, Any, tuple[Any, ...]]]:
    """(name, entry point, its arguments) of every child process. With ``--dp-size N``: the
    controller and N scheduler ranks, each with its share of the CPU threads. The schedulers'
    modules are imported by the children only (``run_entry``): they import torch, which this (HTTP)
    process never needs."""
    run_dp_controller_process = functools.partial(run_entry, "radixserve.server.scheduler.dp_controller:run_dp_controller_process")
    run_scheduler_process = functools.partial(run_entry, "radixserve.server.scheduler.scheduler_proc:run_scheduler_process")
    run_detokenizer_process = functools.partial(run_entry, "radixserve.server.detokenizer_proc:run_detokenizer_process")

    detok = ("detokenizer", run_detokenizer_process, (args, ipc, parent))
    if args.dp_size == 1:
        return [("scheduler", run_scheduler_process, (args, ipc, parent)), *_tp_ranks(args, parent, ipc), detok]
    # NOTE: the ranks share this machine's memory and cores (SGLang's ranks each own a GPU), so
    # --mem-fraction-static is split between them, and the threads too unless --num-threads is set.
    rank_args = args.replace(mem_fraction_static=args.mem_fraction_static / args.dp_size)
    if args.num_threads is None:
        rank_args = rank_args.replace(num_threads=max(1, (os.cpu_count() or 1) // args.dp_size))
    ranks = [(f"scheduler_{r}", run_scheduler_process, (rank_args, ipc, parent, r)) for r in range(args.dp_size)]
    return [("dp_controller", run_dp_controller_process, (args, ipc, parent)), *ranks, detok]


def _hard_exit(procs: dict[str, BaseProcess]) -> None:
    logger.error("graceful shutdown took over %.0f s; killing the server", HARD_EXIT_S)
    for p in procs.values():
        if p.is_alive():
            p.kill()
    os._exit(1)
