"""``TokenizerManager``: the HTTP process's end of the pipeline (asyncio).

It tokenizes, sends ``GenerateReq`` to the scheduler over a ZMQ PUSH, and routes what comes back
on its PULL socket: text deltas from the detokenizer to the waiting request (a ``RequestGroup``:
one asyncio queue for the n choices of one HTTP request), control replies to their futures,
scheduler statistics to the metrics. A request whose HTTP side goes away (client disconnect,
error) is aborted in the scheduler, which frees its KV memory at its next step.

A watchdog checks the child processes; when one dies, every waiting request fails, ``/health``
answers 503 and ``on_fatal`` makes the server exit non-zero.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from multiprocessing.process import BaseProcess
from typing import Any

import zmq
import zmq.asyncio

from radixserve.config import ServerArgs
from radixserve.model.tokenizer import Tokenizer
from radixserve.sched.io import BatchOut, OutRow
from radixserve.server.frontend.metrics import ServerMetrics
from radixserve.server.frontend.recent_requests import RecentRequests
from radixserve.server.frontend.req_state import ReqState
from radixserve.server.io_struct import (
    ENCODER,
    AbortReq,
    ControlReply,
    ControlReq,
    GenerateReq,
    LoadProgress,
    ProcReady,
    SchedulerStats,
    ToTokenizerManager,
    decoder,
)
from radixserve.server.procs import IpcNames

logger = logging.getLogger(__name__)

WATCHDOG_INTERVAL_S = 0.2
CONTROL_TIMEOUT_S = 30.0


class ServerDead(Exception):
    """A server process died; nothing can be answered any more."""


class ServerDraining(ServerDead):
    """The server is shutting down gracefully: it finishes what it has, admits nothing new."""


class ClientGone(Exception):
    """The HTTP client disconnected."""


class RequestGroup:
    """The n requests of one HTTP request; ``outputs()`` yields (state, output) as they come."""

    def __init__(self, tm: TokenizerManager, reqs: list[GenerateReq]) -> None:
        self.tm = tm
        now = time.perf_counter()
        self.reqs = reqs
        self.states = [ReqState(r.rid, i, now, priority=r.priority, tenant=r.tenant) for i, r in enumerate(reqs)]
        self.by_rid = {s.rid: s for s in self.states}
        self.queue: asyncio.Queue[tuple[ReqState, OutRow] | BaseException] = asyncio.Queue()
        self.closed = False
        self._finished_taken = 0

    @property
    def done(self) -> bool:
        """Every request's last output has been taken from the queue (not just received)."""
        return self._finished_taken == len(self.states)

    async def outputs(self) -> AsyncIterator[tuple[ReqState, OutRow]]:
        while not self.done:
            yield await self.next()

    async def next(self) -> tuple[ReqState, OutRow]:
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        if item[1].finished_reason is not None:
            self._finished_taken += 1
        return item

    def fail(self, exc: BaseException) -> None:
        self.queue.put_nowait(exc)

    def close(self) -> None:
        """Forget the group; abort what is still running (idempotent)."""
        if self.closed:
            return
        self.closed = True
        for s in self.states:
            self.tm.unregister(s.rid)
            if not s.finished:
                self.tm.abort(s.rid)


class TokenizerManager:
    tokenizer: Tokenizer  # set once loaded (it loads while the children start)

    def __init__(self, args: ServerArgs, ipc: IpcNames, model_name: str) -> None:
        self.args = args
        self.model_name = model_name
        self.ctx = zmq.asyncio.Context()
        self.to_scheduler = self.ctx.socket(zmq.PUSH)
        self.to_scheduler.setsockopt(zmq.LINGER, 0)
        self.to_scheduler.connect(ipc.scheduler)
        self.recv_sock = self.ctx.socket(zmq.PULL)
        self.recv_sock.setsockopt(zmq.LINGER, 0)
        self.recv_sock.bind(ipc.tokenizer)
        self.decoder = decoder(ToTokenizerManager)
        self.groups: dict[str, RequestGroup] = {}
        self.dp_size = args.dp_size
        # a control request's replies, one per data-parallel rank, gathered until all are in
        self.control_futures: dict[int, tuple[asyncio.Future[list[dict[str, Any]]], dict[int, dict[str, Any]]]] = {}
        self._control_ids = itertools.count()
        self.procs: dict[str, BaseProcess] = {}
        self.info: dict[str, Any] = {}  # from the scheduler's ready message
        self.sched_stats: SchedulerStats | None = None
        self.metrics = ServerMetrics(model_name) if args.enable_metrics else None
        self.recent_requests = RecentRequests()  # TTFT / TPOT of the last finished requests (/dashboard)
        self.dead: str | None = None
        self.draining = False  # set on the first SIGTERM / Ctrl-C (launch.py): no new requests
        self.on_fatal: Callable[[str], None] = lambda reason: None
        self._tasks: list[asyncio.Task[None]] = []

    # --- startup --------------------------------------------------------------------------------
    async def wait_ready(self, procs: dict[str, BaseProcess], on_progress: Callable[[str], None],
                         should_stop: Callable[[], bool]) -> None:
        """Wait for every child's ProcReady; fail fast if one dies or reports an error."""
        self.procs = procs
        pending = set(procs)
        while pending:
            if should_stop():
                raise KeyboardInterrupt
            for name, p in procs.items():
                if not p.is_alive():
                    raise RuntimeError(f"the {name} process exited with code {p.exitcode} while starting")
            if not await self.recv_sock.poll(200):
                on_progress("")
                continue
            msg = self.decoder.decode(await self.recv_sock.recv())
            if isinstance(msg, ProcReady):
                if msg.error:
                    raise RuntimeError(f"the {msg.name} process failed to start: {msg.error}")
                pending.discard(msg.name)
                if msg.name in ("scheduler", "scheduler_0"):
                    self.info = dict(msg.info)
                on_progress(f"{msg.name} ready")
            elif isinstance(msg, LoadProgress):
                on_progress(msg.stage)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._handle_loop()), asyncio.create_task(self._watchdog())]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        self.ctx.destroy(linger=0)

    # --- requests -------------------------------------------------------------------------------
    @property
    def context_len(self) -> int:
        return int(self.info["context_len"])

    async def open(self, reqs: list[GenerateReq]) -> RequestGroup:
        """Register and send the requests of one HTTP request."""
        if self.dead:
            raise ServerDead(self.dead)
        if self.draining:
            raise ServerDraining("draining: it finishes the requests it has and takes no new ones")
        group = RequestGroup(self, reqs)
        if len(group.by_rid) != len(reqs):
            raise ValueError("duplicate request ids")
        for r in reqs:
            if r.rid in self.groups:
                raise ValueError(f"duplicate request id {r.rid!r}")
        for r in reqs:
            self.groups[r.rid] = group
        for r in reqs:
            await self.to_scheduler.send(ENCODER.encode(r))
        if self.metrics is not None:
            self.metrics.num_requests.labels(**self.metrics.labels).inc(len(reqs))
        return group

    def unregister(self, rid: str) -> None:
        self.groups.pop(rid, None)

    def abort(self, rid: str) -> None:
        if self.dead:
            return
        self.to_scheduler.send(ENCODER.encode(AbortReq(rid)))

    async def control(self, op: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """Run a control op on every scheduler; one reply per data-parallel rank, in rank order."""
        if self.dead:
            raise ServerDead(self.dead)
        req_id = next(self._control_ids)
        fut: asyncio.Future[list[dict[str, Any]]] = asyncio.get_running_loop().create_future()
        self.control_futures[req_id] = (fut, {})
        await self.to_scheduler.send(ENCODER.encode(ControlReq(req_id, op, params)))
        try:
            return await asyncio.wait_for(fut, CONTROL_TIMEOUT_S)
        finally:
            self.control_futures.pop(req_id, None)

    # --- the receive loop ---------------------------------------------------------------------------
    async def _handle_loop(self) -> None:
        while True:
            raw = await self.recv_sock.recv()
            try:
                msg = self.decoder.decode(raw)
                if isinstance(msg, BatchOut):
                    self._dispatch(msg)
                elif isinstance(msg, ControlReply):
                    entry = self.control_futures.get(msg.req_id)
                    if entry is not None and not entry[0].done():
                        fut, replies = entry
                        replies[msg.dp_rank] = dict(msg.data)
                        if len(replies) == self.dp_size:
                            fut.set_result([replies[r] for r in sorted(replies)])
                elif isinstance(msg, SchedulerStats):
                    self.sched_stats = msg
                    if self.metrics is not None:
                        self.metrics.on_scheduler_stats(msg)
            except Exception:
                logger.exception("bad message from a server process")

    def _dispatch(self, outs: BatchOut) -> None:
        now = time.perf_counter()
        for e in outs.input_logprobs:  # before the rows: a request's first row may be its last
            group = self.groups.get(e.rid)
            if group is not None:
                group.by_rid[e.rid].input_logprobs = e
        for o in outs:
            group = self.groups.get(o.rid)
            if group is None:  # aborted and forgotten
                continue
            st = group.by_rid[o.rid]
            st.last = o
            st.spec = o.spec or st.spec
            st.text += o.text
            st.output_ids.extend(o.new_token_ids)
            st.logprobs.extend(o.new_logprobs)
            st.top_logprobs.extend(o.new_top_logprobs)
            if st.first_token_time is None and o.new_token_ids:
                st.first_token_time = now
            if o.finished_reason is not None:
                st.finished = True
                self.groups.pop(o.rid, None)  # a finished request needs no abort
                self.recent_requests.add(st, o, now)
                if self.metrics is not None:
                    self.metrics.on_request_finished(st, o, now)
            group.queue.put_nowait((st, o))

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            for name, p in self.procs.items():
                if not p.is_alive():
                    self.mark_dead(f"the {name} process died (exit code {p.exitcode})")
                    return

    def mark_dead(self, reason: str) -> None:
        if self.dead:
            return
        self.dead = reason
        logger.error("%s; failing every request and shutting down", reason)
        for group in set(self.groups.values()):
            group.fail(ServerDead(reason))
        self.groups.clear()
        for fut, _ in self.control_futures.values():
            if not fut.done():
                fut.set_exception(ServerDead(reason))
        self.on_fatal(reason)

    def alive(self) -> bool:
        return self.dead is None and all(p.is_alive() for p in self.procs.values())
