"""``edf``: earliest (TTFT) deadline first.

``Req.deadline`` is an absolute TTFT deadline on the scheduler clock (the server sets it to arrival
+ ``deadline_ms``/``x-ttft-slo-ms``/``ttft_slo_ms`` / 1000; the simulator sets it directly).
Requests without one go last, first come first served among them, and so does a request whose
deadline has already passed: serving a late request first would only push the requests behind it
past their deadlines too (the EDF domino effect under overload). Admission by deadline is
``deadline.py``'s.
"""

from __future__ import annotations

from radixserve.sched.policies.base import PolicyContext, SchedulePolicy
from radixserve.sched.req import Req

INF = float("inf")


def deadline_of(req: Req) -> float | None:
    return getattr(req, "deadline", None)


class EarliestDeadlineFirst(SchedulePolicy):
    name = "edf"

    def order(self, waiting: list[Req], ctx: PolicyContext) -> list[Req]:
        now = ctx.now

        def key(r: Req) -> tuple[int, float, float]:
            d = deadline_of(r)
            # NOTE: a request whose deadline has passed has none left to meet: it joins the requests
            # without one (first come, first served) instead of pushing the others past theirs
            return (ctx.priority_key(r), INF if d is None or d < now else d, r.arrival_time)

        return sorted(waiting, key=key)
