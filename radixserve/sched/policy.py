"""Waiting-queue ordering: one small class per ``--schedule-policy``, registered by name.

A policy returns the waiting queue in the order the ``PrefillAdder`` should try to admit it.
Cache-aware policies (``lpm``, ``dfs-weight``) look at the radix tree (and order as ``fcfs``
without one). ``lpm`` falls back to ``fcfs`` past ``--lpm-fallback-threshold`` waiting requests
(SGLang hard-codes 128; 0 never), though its matches are kept incrementally (``prefix_match``)
so a long queue is cheap; ``dfs-weight`` never falls back, as in SGLang. See docs/scheduling.md.

With ``--enable-priority-scheduling`` the request priority is the first sort key of every policy
(larger value first, or smaller with ``--schedule-low-priority-values-first``), arrival time
breaks ties. To add a policy: subclass ``SchedulePolicy``, decorate with ``@register_policy``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, ClassVar

from radixserve.mem.base_cache import BasePrefixCache
from radixserve.mem.radix_cache import RadixCache
from radixserve.sched.lpm_order import IncrementalLPM
from radixserve.sched.prefix_match import PrefixLengthCache, dfs_weight_order, lpm_sort_keys
from radixserve.sched.req import Req


@dataclass
class PolicyContext:
    tree_cache: BasePrefixCache
    now: float
    enable_priority: bool = False
    low_priority_values_first: bool = False
    default_priority: int = 0
    lpm_fallback_threshold: int = 128
    rng: random.Random | None = None
    in_batch_check_threshold: int = 32  # --in-batch-prefix-caching-check-threshold
    in_batch_deprioritize_threshold: int = 32  # --in-batch-prefix-caching-deprioritize-threshold

    def priority_key(self, req: Req) -> int:
        """Smaller sorts first."""
        if not self.enable_priority:
            return 0
        p = req.priority if req.priority is not None else self.default_priority
        return p if self.low_priority_values_first else -p


class SchedulePolicy:
    name: ClassVar[str] = ""
    cache_aware: ClassVar[bool] = False  # needs prefix matches of the waiting requests

    def order(self, waiting: list[Req], ctx: PolicyContext) -> list[Req]:
        raise NotImplementedError


_REGISTRY: dict[str, type[SchedulePolicy]] = {}


def register_policy(cls: type[SchedulePolicy]) -> type[SchedulePolicy]:
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    _REGISTRY[cls.name] = cls
    return cls


def get_policy(name: str) -> SchedulePolicy:
    try:
        return _REGISTRY[name]()
    except KeyError:
        raise ValueError(f"unknown schedule policy {name!r}; choose from {sorted(_REGISTRY)}") from None


def policy_names() -> list[str]:
    return sorted(_REGISTRY)


def _sorted(waiting: list[Req], ctx: PolicyContext, key: Callable[[Req], Any]) -> list[Req]:
    return sorted(waiting, key=lambda r: (ctx.priority_key(r), key(r), r.arrival_time))


@register_policy
class FCFS(SchedulePolicy):
    """First come, first served (by arrival; a retracted request keeps its place)."""

    name = "fcfs"

    def order(self, waiting: list[Req], ctx: PolicyContext) -> list[Req]:
        return _sorted(waiting, ctx, lambda r: 0)


@register_policy
class LongestPrefixMatch(SchedulePolicy):
    """Longest cached prefix first: requests that reuse the most KV go first. Requests that share
    an uncached prefix with one ahead of them go to the back (in-batch prefix caching). Past
    ``lpm_fallback_threshold`` waiting requests, fcfs. Matches are kept incrementally
    (``PrefixLengthCache``), so a large queue is cheap and the fallback can be turned off."""

    name = "lpm"
    cache_aware = True

    def __init__(self) -> None:
        self.matches = PrefixLengthCache()
        self.incremental = IncrementalLPM(self.matches)

    def order(self, waiting: list[Req], ctx: PolicyContext) -> list[Req]:
        if not isinstance(ctx.tree_cache, RadixCache) or (
            ctx.lpm_fallback_threshold and len(waiting) > ctx.lpm_fallback_threshold
        ):
            self.incremental.reset()
            return FCFS().order(waiting, ctx)
        if not ctx.enable_priority:  # the same order, kept up to date between rounds (lpm_order.py)
            return self.incremental.order(waiting, ctx.tree_cache, ctx.in_batch_check_threshold,
                                          ctx.in_batch_deprioritize_threshold)
        self.incremental.reset()
        keys = lpm_sort_keys(waiting, ctx.tree_cache, self.matches, ctx.in_batch_check_threshold,
                             ctx.in_batch_deprioritize_threshold)
        if ctx.enable_priority:
            return [r for _, _, r in sorted(zip(map(ctx.priority_key, waiting), keys, waiting, strict=True),
                                             key=itemgetter(0, 1))]
        return list(map(waiting.__getitem__, sorted(range(len(waiting)), key=keys.__getitem__)))


@register_policy
class DFSWeight(SchedulePolicy):
    """Depth-first over the radix tree, heaviest subtree (most waiting requests) first; see
    ``prefix_match.dfs_weight_order``. No fcfs fallback, as in SGLang."""

    name = "dfs-weight"
    cache_aware = True

    def order(self, waiting: list[Req], ctx: PolicyContext) -> list[Req]:
        if not isinstance(ctx.tree_cache, RadixCache):
            return FCFS().order(waiting, ctx)
        out = dfs_weight_order(waiting, ctx.tree_cache)
        return sorted(out, key=ctx.priority_key) if ctx.enable_priority else out


@register_policy
class LongestOutputFirst(SchedulePolicy):
    """Largest max_new_tokens first."""

    name = "lof"

    def order(self, waiting: list[Req], ctx: PolicyContext) -> list[Req]:
        return _sorted(waiting, ctx, lambda r: -r.max_new_tokens)


@register_policy
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
