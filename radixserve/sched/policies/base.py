"""Waiting-queue ordering: one small class per ``--schedule-policy``, registered by name.

A policy returns the waiting queue in the order the ``PrefillAdder`` should try to admit it.
Cache-aware policies (``lpm``, ``dfs-weight``) look at the radix tree (and order as ``fcfs``
without one). ``lpm`` falls back to ``fcfs`` past ``--lpm-fallback-threshold`` waiting requests
(SGLang hard-codes 128; 0 never), though its matches are kept incrementally (``prefix_match.py``)
so a long queue is cheap; ``dfs-weight`` never falls back, as in SGLang. See docs/scheduling.md.

With ``--enable-priority-scheduling`` the request priority is the first sort key of every policy
(larger value first, or smaller with ``--schedule-low-priority-values-first``), arrival time
breaks ties. To add a policy: subclass ``SchedulePolicy`` and list it in ``registry.BUILTIN`` (or,
from a plugin file, decorate it with ``registry.register_policy``).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from radixserve.mem.radix_cache import RadixCache
from radixserve.sched.priority import PrioritySettings
from radixserve.sched.req import Req
from radixserve.sched.schedule_batch import ScheduleBatch


@dataclass
class PolicyContext:
    prefix_tree: RadixCache | None  # read-only: a policy orders requests, it never locks or frees
    now: float
    prio: PrioritySettings = PrioritySettings()
    lpm_fallback_threshold: int = 128
    rng: random.Random | None = None
    in_batch_check_threshold: int = 32  # --in-batch-prefix-caching-check-threshold
    in_batch_deprioritize_threshold: int = 32  # --in-batch-prefix-caching-deprioritize-threshold

    @property
    def enable_priority(self) -> bool:
        return self.prio.enabled

    def priority_key(self, req: Req) -> int:
        """Smaller sorts first (``PrioritySettings.rank``)."""
        return self.prio.rank(req)


class SchedulePolicy:
    name: ClassVar[str] = ""
    cache_aware: ClassVar[bool] = False  # needs prefix matches of the waiting requests

    def order(self, waiting: list[Req], ctx: PolicyContext) -> list[Req]:
        raise NotImplementedError

    def on_admitted(self, reqs: list[Req]) -> None:
        """Called when ``reqs`` leave the waiting queue for a prefill batch (``lpm`` stops watching
        their matches)."""

    def on_batch(self, batch: ScheduleBatch) -> None:
        """Called after each forward step's results were processed (``vtc`` charges its counters)."""


def _sorted(waiting: list[Req], ctx: PolicyContext, key: Callable[[Req], Any]) -> list[Req]:
    return sorted(waiting, key=lambda r: (ctx.priority_key(r), key(r), r.arrival_time))
