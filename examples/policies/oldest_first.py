"""An example schedule policy plugin: oldest first, with a cap on how many requests of one tenant
go ahead of everyone else's per round.

Use it without touching radixserve:

    radixserve serve --policy-plugin examples/policies/oldest_first.py --schedule-policy oldest-first

or switch a running server to it (the file must have been loaded with --policy-plugin, or name the
class as module.path:ClassName if it is importable):

    curl -X POST localhost:30000/set_schedule_policy \\
         -d '{"schedule_policy": "oldest-first", "per_tenant": 2}'
"""

from __future__ import annotations

from typing import Any

from radixserve.sched.policies import PolicyContext, SchedulePolicy, register_policy
from radixserve.sched.req import Req


@register_policy
class OldestFirst(SchedulePolicy):
    """Oldest arrival first (priority classes still first); at most ``per_tenant`` requests of one
    tenant are placed before the first request of any other tenant (0: no cap)."""

    name = "oldest-first"

    def __init__(self) -> None:
        self.per_tenant = 0

    def configure(self, args: Any, **params: Any) -> None:
        """Called after construction with the server arguments and the extra live-switch params."""
        self.per_tenant = int(params.pop("per_tenant", 0))
        if params:
            raise ValueError(f"oldest-first takes only per_tenant, got {sorted(params)}")

    def order(self, waiting: list[Req], ctx: PolicyContext) -> list[Req]:
        out = sorted(waiting, key=lambda r: (ctx.priority_key(r), r.arrival_time))
        if not self.per_tenant:
            return out
        head: list[Req] = []
        tail: list[Req] = []
        seen: dict[str, int] = {}
        for r in out:
            t = getattr(r, "tenant", None) or ""
            seen[t] = seen.get(t, 0) + 1
            (head if seen[t] <= self.per_tenant else tail).append(r)
        return head + tail
