"""``ForwardThread``: where the overlap loop's forwards run.

SGLang's overlap loop schedules step N+1 while step N's forward runs, so the forward runs on a
thread of its own (one forward after the other). Step N+1 is built before step N's tokens are
known: a request's next input id is then a placeholder ``-(i + 1)`` (the ``i``-th sample of the
forward in flight, ``ScheduleBatch.to_forward_batch(pending=...)``), which the thread replaces with
the real token right before the forward.

A request that ends while a forward that includes it is still running keeps its KV and its
request slot (whose row that forward reads) until the forward is done: ``hold`` keeps it,
``release_held`` gives back what no running forward includes any more.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from radixserve.mem.forward_batch import ForwardBatch, ForwardOutput, Runner
from radixserve.sched.kv_manager import KVManager
from radixserve.sched.req import Req
from radixserve.sched.schedule_batch import ScheduleBatch


@dataclass
class InFlight:
    """A step whose forward runs on the forward thread."""

    batch: ScheduleBatch  # a snapshot: the running batch is rebuilt for the next step meanwhile
    fb: ForwardBatch
    future: Future[tuple[ForwardOutput, float]]  # the output, and the forward's own seconds
    ids: frozenset[int]  # id() of its requests


class ForwardThread:
    def __init__(self, runner: Runner, kv: KVManager, clock: Callable[[], float]) -> None:
        self.runner = runner
        self.kv = kv
        self.clock = clock
        self.in_flight: InFlight | None = None
        self.held: list[Req] = []  # ended while in flight; their KV waits for the forward
        self._pool: ThreadPoolExecutor | None = None
        self._last_tokens: torch.Tensor | None = None  # what the placeholders of the next forward stand for

    def includes(self, req: Req) -> bool:
        """Whether the forward in flight includes ``req``."""
        running = self.in_flight
        return running is not None and id(req) in running.ids

    def hold(self, req: Req) -> bool:
        """Keep an ended ``req``'s KV until the forward that includes it is done; False if none does."""
        if self.includes(req):
            self.held.append(req)
            return True
        return False

    def release_held(self) -> None:
        held, self.held = self.held, []
        for req in held:
            if self.includes(req):
                self.held.append(req)
            else:
                self.kv.release(req)

    def launch(self, batch: ScheduleBatch, prev: InFlight | None) -> None:
        """Start ``batch``'s forward after ``prev``'s (whose samples its placeholders stand for).
        Raises what building the forward batch raised (nothing is in flight then)."""
        self.in_flight = None
        pending = {id(r): j for j, r in enumerate(prev.batch.reqs)} if prev is not None else None
        try:
            fb = batch.to_forward_batch(pending=pending)
        except Exception:
            if prev is not None:
                prev.future.exception()  # its forward may read the rows the caller frees: let it end first
            raise
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")
        future = self._pool.submit(self._forward, fb, pending is not None)
        self.in_flight = InFlight(batch.snapshot(), fb, future, frozenset(map(id, batch.reqs)))

    def take(self) -> InFlight | None:
        """The step in flight, which the caller now waits for (``result``); nothing is in flight after."""
        running, self.in_flight = self.in_flight, None
        return running

    @staticmethod
    def result(step: InFlight) -> tuple[ForwardOutput, float]:
        """Wait for ``step``'s forward: its output and its own seconds; raises what it raised."""
        return step.future.result()

    def _forward(self, fb: ForwardBatch, resolve: bool) -> tuple[ForwardOutput, float]:
        """On the forward thread: replace the placeholders with the previous forward's samples,
        run, keep this forward's samples. The duration is on the scheduler's clock."""
        if resolve:
            ids = fb.input_ids
            mask = ids < 0
            if bool(mask.any()):
                last = self._last_tokens
                if last is None:
                    raise RuntimeError("the step this one continues failed")
                ids[mask] = last[-ids[mask] - 1]
        self._last_tokens = None
        t0 = self.clock()
        out = self.runner.forward(fb)
        dt = self.clock() - t0
        self._last_tokens = torch.tensor(out.next_token_ids, dtype=torch.int64)
        return out, dt
