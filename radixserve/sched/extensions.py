"""The scheduling extensions' hooks the scheduler calls (docs/scheduling.md): ordering with aging, returned
victims and queue-aware marking, per-step observation (prefill throughput for deadline admission,
the policy's ``on_batch``), first-admission accounting."""

from __future__ import annotations

from typing import TYPE_CHECKING

import radixserve.sched.fairness
import radixserve.sched.sjf  # noqa: F401 (registers sjf; fairness registers vtc, deadline edf)
from radixserve.sched.aging import note_first_admission, order_with_aging
from radixserve.sched.deadline import PrefillThroughput
from radixserve.sched.queue_aware import mark_wanted
from radixserve.sched.req import Req

if TYPE_CHECKING:
    from radixserve.sched.schedule_batch import ScheduleBatch
    from radixserve.sched.scheduler import Scheduler


class SchedExtensions:
    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.throughput = PrefillThroughput(sched.args.deadline_prefill_tokens_per_s)
        self.returned: dict[int, Req] = {}  # preempted / retracted requests, until admitted again

    def note_victims(self, reqs: list[Req]) -> None:
        """``reqs`` went back to the waiting queue (priority preemption or decode retraction)."""
        for r in reqs:
            self.returned[id(r)] = r

    def order(self, waiting: list[Req]) -> list[Req]:
        sched = self.sched
        ctx = sched.policy_context()
        out = order_with_aging(sched, sched.policy.order(waiting, ctx), ctx.now, self._any_returned_waiting())
        mark_wanted(sched)
        return out

    def _any_returned_waiting(self) -> bool:
        """Whether a returned victim is still waiting (it holds no request slot and is unfinished);
        forgets the others. O(victims), not O(queue)."""
        ret = self.returned
        if ret:
            for k in [k for k, r in ret.items() if r.req_pool_idx is not None or r.finished_reason is not None]:
                del ret[k]
        return bool(ret)

    def on_batch(self, batch: ScheduleBatch) -> None:
        sched = self.sched
        self.throughput.observe(batch, sched)
        hook = getattr(sched.policy, "on_batch", None)
        if hook is not None:
            hook(batch, sched)

    def on_first_admission(self, req: Req, now: float) -> None:
        note_first_admission(self.sched, req, now)
