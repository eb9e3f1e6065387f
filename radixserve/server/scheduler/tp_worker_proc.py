"""The server's tensor-parallel ranks 1..N-1: child processes named ``tp_<rank>``.

Each joins the group, loads its shard, reports ready to the HTTP process (node 0 only: the ranks
of other nodes have no HTTP process to report to) and then runs the steps rank 0, the scheduler
process, broadcasts (model/tp_worker.py). It exits when rank 0 stops or goes away, or when its
parent process does.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback

import zmq

from radixserve.config import ServerArgs
from radixserve.model.tp_worker import exit_with_parent, load_tp_rank, peer_gone, serve_tp_rank
from radixserve.server.io_struct import ENCODER, ProcReady
from radixserve.server.procs import IpcNames, child_init, push_socket

logger = logging.getLogger(__name__)


def run_tp_worker_process(args: ServerArgs, ipc: IpcNames | None, parent_pid: int, rank: int) -> None:
    name = f"tp_{rank}"
    child_init(args.log_level, f"TP{rank}")
    exit_with_parent(parent_pid)  # the main thread waits inside a broadcast, blind to its parent
    ctx = zmq.Context()
    to_tm = push_socket(ctx, ipc.tokenizer) if ipc is not None else None

    def report(msg: ProcReady) -> None:
        if to_tm is not None:
            to_tm.send(ENCODER.encode(msg))

    try:
        runner = load_tp_rank(args, rank)
    except Exception as e:
        logger.error("tensor-parallel rank %d failed to start:\n%s", rank, traceback.format_exc())
        report(ProcReady(name, error=f"{type(e).__name__}: {e}"))
        time.sleep(0.2)  # let the message leave before the context goes
        sys.exit(1)
    try:
        serve_tp_rank(runner, lambda: report(ProcReady(name, info={"pid": os.getpid(), "tp_rank": rank})))
    except RuntimeError as e:
        if not peer_gone(e):
            raise
        logger.info("rank 0 or another rank went away; exiting")
        ctx.destroy(linger=0)
        logging.shutdown()
        # NOTE: not a normal exit: the gloo group's threads still wait on the peer that left, and its
        # destructor then aborts the process ("terminate called without an active exception", -6)
        os._exit(0)
    finally:
        ctx.destroy(linger=0)
