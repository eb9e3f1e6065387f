"""What the scheduler and its managers share: ``Queues`` (where every unfinished request is) and
the ``Clock`` they all read."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from radixserve.sched.req import Req
from radixserve.sched.schedule_batch import ScheduleBatch


@dataclass
class Queues:
    max_running_requests: int
    waiting: list[Req] = field(default_factory=list)
    running: ScheduleBatch = field(default_factory=ScheduleBatch)
    chunked: Req | None = None  # the request whose prompt is being prefilled chunk by chunk
    by_rid: dict[str, Req] = field(default_factory=dict)  # every unfinished request

    def remove_waiting(self, reqs: list[Req]) -> None:
        """Take ``reqs`` out of the waiting queue (identity compare; the head in the usual case)."""
        wq = self.waiting
        if wq[: len(reqs)] == reqs:
            self.waiting = wq[len(reqs) :]
        else:
            gone = {id(r) for r in reqs}
            self.waiting = [r for r in wq if id(r) not in gone]


class Clock:
    """The scheduler's time: wall time on the engine, virtual time under the simulator. Every
    manager reads the same ``Clock``, so replacing its ``source`` (a test, a replay) moves them all."""

    __slots__ = ("source",)

    def __init__(self, source: Callable[[], float] = time.monotonic) -> None:
        self.source = source

    def __call__(self) -> float:
        return self.source()
