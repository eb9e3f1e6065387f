"""The policies that need no prefix cache: ``fcfs``, ``lof`` (longest output first), ``random``."""

from __future__ import annotations

import random

from radixserve.sched.policies.base import PolicyContext, SchedulePolicy, _sorted
from radixserve.sched.req import Req


class FCFS(SchedulePolicy):
    """First come, first served (by arrival; a retracted request keeps its place)."""

    name = "fcfs"

    def order(self, waiting: list[Req], ctx: PolicyContext) -> list[Req]:
        return _sorted(waiting, ctx, lambda r: 0)


class LongestOutputFirst(SchedulePolicy):
    """Largest max_new_tokens first."""

    name = "lof"

    def order(self, waiting: list[Req], ctx: PolicyContext) -> list[Req]:
        return _sorted(waiting, ctx, lambda r: -r.max_new_tokens)


class RandomOrder(SchedulePolicy):
    """A random order (priority classes still first)."""

    name = "random"

    def order(self, waiting: list[Req], ctx: PolicyContext) -> list[Req]:
        rng = ctx.rng or random.Random(0)
        shuffled = list(waiting)
        rng.shuffle(shuffled)
        if not ctx.enable_priority:
            return shuffled
        return sorted(shuffled, key=ctx.priority_key)  # stable: random within a class
