"""What every server process shares: socket addresses, logging, and the parent watch.

The HTTP process makes a temp dir and binds/connects ipc:// sockets in it::

    <dir>/scheduler     PULL bound by the scheduler process   (HTTP process PUSHes requests)
    <dir>/detokenizer   PULL bound by the detokenizer process (scheduler PUSHes token batches)
    <dir>/tokenizer     PULL bound by the HTTP process        (detokenizer and scheduler PUSH)

With ``--dp-size N`` the data-parallel controller binds ``<dir>/scheduler`` and ``<dir>/dp_load``
and scheduler rank r binds ``<dir>/scheduler_<r>``.

Children are started with the multiprocessing "spawn" context (torch and fork do not mix) and exit
on their own when the HTTP process goes away (``parent_alive``), so nothing is ever orphaned.
"""

from __future__ import annotations

import importlib
import logging
import os
import select
import shutil
import signal
import tempfile
import threading
from dataclasses import dataclass
from typing import Any

import zmq

LOG_FORMAT = "[%(asctime)s %(proc)s] %(message)s"


@dataclass(frozen=True)
class IpcNames:
    dir: str

    @classmethod
    def new(cls) -> IpcNames:
        return cls(tempfile.mkdtemp(prefix="radixserve-ipc-"))

    @property
    def scheduler(self) -> str:
        return f"ipc://{self.dir}/scheduler"

    def scheduler_rank(self, rank: int) -> str:
        """With --dp-size: the PULL socket of scheduler rank ``rank`` (the controller PUSHes)."""
        return f"ipc://{self.dir}/scheduler_{rank}"

    @property
    def dp_load(self) -> str:
        """With --dp-size: the controller's PULL socket for the ranks' load reports."""
        return f"ipc://{self.dir}/dp_load"

    @property
    def detokenizer(self) -> str:
        return f"ipc://{self.dir}/detokenizer"

    @property
    def tokenizer(self) -> str:
        return f"ipc://{self.dir}/tokenizer"

    def cleanup(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


class _ProcFilter(logging.Filter):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.proc = name

    def filter(self, record: logging.LogRecord) -> bool:
        record.proc = self.proc
        return True


def run_entry(entry: str, *args: Any) -> Any:
    """A child process's target: imports ``entry`` ("module:function") in the child and calls it, so
    the parent never imports what only the child needs (the scheduler's torch: ~200 MB and a second
    of start-up in the HTTP process). ``functools.partial(run_entry, entry)`` pickles by name."""
    module, _, name = entry.partition(":")
    return getattr(importlib.import_module(module), name)(*args)


def setup_logging(level: str, proc: str) -> None:
    """One format for all processes, tagged with the process role (as SGLang's ``[TP0]``)."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(LOG_FORMAT, datefmt="%Y-%m-%d %H:%M:%S"))
    handler.addFilter(_ProcFilter(proc))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())


def child_init(level: str, proc: str, progress_bars: bool = True) -> None:
    """Common start of a child process: logging, and Ctrl-C left to the HTTP process, which
    receives it too (same process group) and shuts the children down in order (SIGTERM).
    ``progress_bars``: whether it may show tqdm's bars (a process that never does skips importing it).

    NOTE: tqdm's default lock is a multiprocessing semaphore, which a SIGTERM'd process would
    leave to the resource tracker to complain about; a thread lock does as well here."""
    setup_logging(level, proc)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if progress_bars:
        from tqdm import tqdm

        tqdm.set_lock(threading.RLock())


_requester: tuple[int, int | None] | None = None  # (pid, its pidfd) of who asked a zygote for this one


def watch_requester(pid: int) -> None:
    """In a child forked by the zygote (``zygote.py``): ``parent_alive`` watches ``pid``, the
    process that asked for it, through a pidfd opened now, while that process waits for the answer
    (a pid number alone could be reused once it exits; without pidfds, Linux before 5.3, it is
    all there is)."""
    global _requester
    try:
        _requester = (pid, os.pidfd_open(pid))
    except (OSError, AttributeError):
        _requester = (pid, None)


def parent_alive(parent_pid: int) -> bool:
    if _requester is not None:
        pid, fd = _requester
        if fd is not None:  # readable once that process has exited
            return not select.select([fd], [], [], 0)[0]
        return pid_alive(pid)
    return os.getppid() == parent_pid


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (ours to signal or not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def push_socket(ctx: zmq.Context, addr: str) -> zmq.Socket:
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 0)
    # a peer that has not bound yet (the HTTP process binds after starting its children): retry
    # after 10 ms, doubling up to 100 ms, instead of zmq's fixed 100 ms from the start; what is sent
    # meanwhile queues
    s.setsockopt(zmq.RECONNECT_IVL, 10)
    s.setsockopt(zmq.RECONNECT_IVL_MAX, 100)
    s.connect(addr)
    return s


def drain(sock: zmq.Socket) -> list[bytes]:
    """Every message waiting on ``sock`` now, without blocking."""
    out = []
    while True:
        try:
            out.append(sock.recv(zmq.NOBLOCK))
        except zmq.Again:
            return out


def pull_socket(ctx: zmq.Context, addr: str) -> zmq.Socket:
    s = ctx.socket(zmq.PULL)
    s.setsockopt(zmq.LINGER, 0)
    s.bind(addr)
    return s
