"""``Queues``: where every unfinished request is, shared by the scheduler and its managers."""

from __future__ import annotations

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
