"""Tensor-parallel ranks 1..N-1: load this rank's shard, mirror rank 0's pools, run every step
rank 0 broadcasts, until it says stop or goes away.

These ranks hold no scheduler and no requests: rank 0 decides every step and sends it as a
``ForwardBatch`` plus the request-table writes since the last step (parallel.py). They do not
sample either; only their share of the collectives leaves them.

``spawn_tp_ranks`` starts them as processes of this machine (the in-process ``Engine``); the server
starts them as its children (server/scheduler/tp_worker_proc.py).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable
from multiprocessing.process import BaseProcess

import torch

from radixserve.config import ServerArgs
from radixserve.mem.kv_pool import ReqToTokenPool, replay_journal
from radixserve.model.model_runner import ModelRunner, runner_from_args
from radixserve.model.parallel import TPGroup, init_tp_group, recv_step

logger = logging.getLogger(__name__)


def free_local_addr() -> str:
    """A free port on this machine for the group's TCP store (what --dist-init-addr defaults to)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def with_tp_defaults(args: ServerArgs) -> ServerArgs:
    """Resolve what the tensor-parallel options leave open: the store address (a free local port)
    and each rank's threads (this machine's cores shared by the ranks it runs)."""
    if args.dist_init_addr is None:
        args = args.replace(dist_init_addr=free_local_addr())
    if args.num_threads is None:
        args = args.replace(num_threads=max(1, (os.cpu_count() or 1) // args.tp_ranks_per_node))
    return args


def load_tp_rank(args: ServerArgs, rank: int, alive: Callable[[], bool] | None = None) -> ModelRunner:
    """Join the group as ``rank`` and load that rank's shard of ``args.model_path``."""
    assert args.dist_init_addr is not None
    tp = init_tp_group(rank, args.tp_size, args.dist_init_addr, alive=alive)
    try:
        return runner_from_args(args, progress=False, tp_group=tp)
    except BaseException:
        tp.destroy()
        raise


def serve_tp_rank(runner: ModelRunner, on_ready: Callable[[], None] | None = None) -> None:
    """Ranks > 0: build the pools rank 0 sized, then run its steps until it stops. A rank 0 that
    dies surfaces here as an error of the broadcast (gloo sees its connection close)."""
    tp = runner.tp
    assert isinstance(tp, TPGroup) and tp.rank > 0
    total, page_size, req_slots, context_len = tp.broadcast_(
        torch.empty(4, dtype=torch.int64, device=tp.device)).tolist()
    kv = runner.make_kv_pool(total, page_size)
    r2t = ReqToTokenPool(req_slots, context_len)
    runner.attach_pools(kv, r2t)
    if on_ready is not None:
        on_ready()
    steps = 0
    while (msg := recv_step(tp)) is not None:
        fb, journal = msg
        replay_journal(r2t, journal)
        with torch.inference_mode():
            runner.model(fb, kv, r2t)
        steps += 1
    logger.info("tensor-parallel rank %d: stop after %d steps", tp.rank, steps)
    runner.shutdown()


def exit_with_parent(parent_pid: int, interval: float = 0.5) -> None:
    """Exit this process when ``parent_pid`` is no longer its parent. A thread, because the main
    thread spends its idle time blocked inside a broadcast."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def tp_rank_main(args: ServerArgs, rank: int, parent_pid: int) -> None:
    """Entry point of a rank ``spawn_tp_ranks`` started."""
    from tqdm import tqdm

    logging.basicConfig(level=args.log_level.upper(), format=f"[TP{rank}] %(message)s")
    # tqdm's default lock is a multiprocessing semaphore, which a killed rank would leak
    tqdm.set_lock(threading.RLock())
    exit_with_parent(parent_pid)
    runner = load_tp_rank(args, rank)
    try:
        serve_tp_rank(runner)
    except RuntimeError as e:
        if not peer_gone(e):
            raise
        logger.info("tensor-parallel rank %d: the group is gone (%s); exiting", rank, str(e).splitlines()[0])


def peer_gone(e: BaseException) -> bool:
    """Whether a collective failed because another rank's process ended (rank 0 stopped without a
    stop message, or a rank died): gloo reports the closed connection."""
    text = str(e)
    return "Connection closed by peer" in text or "Connection reset by peer" in text


def spawn_tp_ranks(args: ServerArgs, ranks: Iterable[int]) -> list[BaseProcess]:
    """Start ``ranks`` as processes of this machine (spawn: torch and fork do not mix)."""
    ctx = mp.get_context("spawn")
    procs: list[BaseProcess] = []
    for r in ranks:
        p = ctx.Process(target=tp_rank_main, args=(args, r, os.getpid()), name=f"radixserve-tp_{r}", daemon=True)
        p.start()
        procs.append(p)
    return procs


def stop_tp_ranks(runners: list[ModelRunner], procs: list[BaseProcess], threads: int, timeout: float = 10.0) -> None:
    """Stop ranks 1..N-1 (``procs``) of the engine whose rank 0 is ``runners[0]`` (if it was loaded)."""
    for runner in runners:
        runner.shutdown()  # the stop message, then leave the group
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            p.kill()
            p.join(1.0)
    torch.set_num_threads(threads)  # rank 0 took its share of this process's threads
