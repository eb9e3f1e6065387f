"""A process that has imported what a scheduler needs and forks schedulers for whoever asks.

``radixserve launch`` starts one for all its workers. Every scheduler process otherwise begins by
importing torch and the model code and loading the C++ extensions: ~2 s of a core each, which on a
small machine running N workers at once is most of what their start-up waits for. Forked from the
zygote, a scheduler starts with all of that done (and its pages shared until written).

    zygote (own session)  --fork-->  scheduler of worker 1, scheduler of worker 2, ...
       ^ unix socket: one connection per child: the request (the pickled entry point and its
       | arguments, the requester's stdout/stderr passed along), then the child's pid, later its
       | exit code
    worker's HTTP process: ``ZygoteChild``, the few methods of a ``multiprocessing`` process it uses

The zygote binds its socket at once and imports afterwards, so requests made while it loads wait
in the backlog. It never runs torch itself (no thread pools exist at a fork), exits when its parent
does, and is in a session of its own, so a terminal's Ctrl-C goes to the router alone. A forked
child watches its requester (the worker's HTTP process) through a pidfd opened at the fork: it is
not that process's child, so ``procs.parent_alive``'s parent-pid check would not do.
"""

from __future__ import annotations

import importlib
import os
import pickle
import select
import signal
import socket
import struct
import sys
import time
import traceback
from typing import Any

from radixserve.server.procs import pid_alive

PRELOAD = ("torch", "radixserve.server.scheduler.scheduler_proc")
_LEN = struct.Struct("<Q")
_MSG = struct.Struct("<cq")  # b"P" pid, or b"X" exit code (negative: the signal that ended it)


def _preload() -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    # the C++ extensions: a build or a stamped load here, once, not in every scheduler
    from radixserve.model import dequant, fused_ops, paged_attention

    paged_attention.extension_error()
    fused_ops.extension_error()
    dequant.has_bf16_kernel()
    dequant.vnni_ext()


def serve(path: str, parent_pid: int) -> None:
    """The zygote's main loop (a child of ``parent_pid``; returns when that process is gone)."""
    os.setsid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    _preload()
    children: dict[int, socket.socket] = {}
    while os.getppid() == parent_pid:
        if select.select([listener], [], [], 0.1)[0]:
            conn, _ = listener.accept()
            pid = _fork_one(conn, listener, children)
            if pid:
                children[pid] = conn
                _tell(conn, b"P", pid)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            if pid in children:
                done = children.pop(pid)
                _tell(done, b"X", os.waitstatus_to_exitcode(status))
                done.close()
    listener.close()


def _tell(conn: socket.socket, kind: bytes, value: int) -> None:
    try:
        conn.sendall(_MSG.pack(kind, value))
    except OSError:  # the requester is gone; its child watches it and ends on its own
        pass


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        part = conn.recv(n - len(buf))
        if not part:
            raise EOFError("the requester went away")
        buf += part
    return buf


def _fork_one(conn: socket.socket, listener: socket.socket, children: dict[int, socket.socket]) -> int:
    """Read one request from ``conn`` and fork its child: the child's pid here (0 if the request
    was unreadable); the child runs the entry point and never returns."""
    fds: list[int] = []
    try:
        head, fds, _, _ = socket.recv_fds(conn, _LEN.size, 2)
        if len(head) < _LEN.size or len(fds) != 2:
            raise EOFError("a request without its length and two descriptors")
        (n,) = _LEN.unpack(head)
        target, args, requester = pickle.loads(_recv_exact(conn, n))
    except Exception:
        traceback.print_exc()
        for fd in fds:
            os.close(fd)
        conn.close()
        return 0
    pid = os.fork()
    if pid:
        for fd in fds:
            os.close(fd)
        return pid
    code = 1
    try:
        listener.close()
        for other in children.values():
            other.close()
        conn.close()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in fds:
            os.close(fd)
        from radixserve.server import procs

        procs.watch_requester(requester)
        target(*args)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class ZygoteChild:
    """A child forked by the zygote, as the HTTP process sees it: what ``multiprocessing``'s
    ``BaseProcess`` offers that the server uses (``pid``, ``is_alive``, ``exitcode``,
    ``terminate``, ``kill``, ``join``)."""

    def __init__(self, path: str, name: str, target: Any, args: tuple[Any, ...]) -> None:
        self.name = name
        self._pid: int | None = None
        self._exitcode: int | None = None
        self._sock = _connect(path)
        body = pickle.dumps((target, args, os.getpid()))
        socket.send_fds(self._sock, [_LEN.pack(len(body))], [sys.stdout.fileno(), sys.stderr.fileno()])
        self._sock.sendall(body)
        self._buf = b""

    def _read(self, timeout: float, until: Any = None) -> None:
        """Take what the zygote sends within ``timeout`` seconds (0: only what is there already),
        stopping early once ``until()`` holds or the child's exit code is known."""
        deadline = time.monotonic() + timeout
        while self._exitcode is None and not (until is not None and until()):
            left = max(0.0, deadline - time.monotonic())
            if not select.select([self._sock], [], [], left)[0]:
                return
            part = self._sock.recv(64)
            if not part:  # the zygote is gone: judge the child by its pid
                if self._pid is None or not pid_alive(self._pid):
                    self._exitcode = -signal.SIGKILL
                return
            self._buf += part
            while len(self._buf) >= _MSG.size:
                kind, value = _MSG.unpack(self._buf[: _MSG.size])
                self._buf = self._buf[_MSG.size :]
                if kind == b"P":
                    self._pid = value
                else:
                    self._exitcode = value

    @property
    def pid(self) -> int:
        # the zygote answers once it has loaded (seconds; minutes if it builds the extensions)
        self._read(600.0, until=lambda: self._pid is not None)
        if self._pid is None:
            raise RuntimeError(f"the zygote did not start {self.name}")
        return self._pid

    @property
    def exitcode(self) -> int | None:
        self._read(0)
        return self._exitcode

    def is_alive(self) -> bool:
        return self.exitcode is None

    def _signal(self, sig: int) -> None:
        if self.is_alive():
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def join(self, timeout: float | None = None) -> None:
        self._read(1e9 if timeout is None else timeout)


def _connect(path: str, timeout: float = 30.0) -> socket.socket:
    """Connect to the zygote's socket, waiting for it to be bound (the zygote and the workers start
    together)."""
    deadline = time.monotonic() + timeout
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            return sock
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            if time.monotonic() > deadline:
                raise RuntimeError(f"no scheduler zygote answers at {path}") from None
            time.sleep(0.02)


if __name__ == "__main__":  # python -m radixserve.server.zygote SOCKET_PATH PARENT_PID (radixserve launch)
    serve(sys.argv[1], int(sys.argv[2]))
