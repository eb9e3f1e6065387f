"""``Ordering``: the waiting queue's order each prefill round: the policy's, then aging and the
place of returned victims, then the queue-aware eviction marks (``KVManager.mark_wanted``).

Aging and returned victims apply to every policy's order.

``order_with_aging`` re-sorts a policy's output stably, so the policy's own order survives within
each key:

1. requests that waited ``--priority-aging-horizon`` seconds or more go first, oldest first: the
   bound (no request waits past the horizon while the engine could serve it; the adder stops at
   the first request that does not fit, so nothing younger jumps it);
2. then by priority rank minus ``floor(--priority-aging-rate * wait)``: a request gains one
   priority unit per ``1/rate`` seconds of wait (with priorities off every rank is 0, so aging
   alone orders by wait in ``1/rate``-second buckets and the policy orders within a bucket);
3. requests returning from preemption or retraction go first within their class, so they keep
   their place at its front (``returns_to_front``: whenever the thrash guard is on,
   ``--max-preemptions-per-request`` > 0, and always with ``--retract-victim-policy
   min-recompute``). A class is a priority rank (aged, with a rate); with priorities off there is
   one class. The flag is ``Req.admitted_before``: every waiting request that has it is a victim
   that came back. Without it, ``fcfs`` puts them by arrival time (at the back when arrival times
   tie) and the others (``lpm``, ``sjf``, ``edf``, ``vtc``, ...) wherever their key says.

Wait is measured from ``Req.queue_entry_time`` (set once when queued; a returned victim keeps it).
Without a rate, a horizon or a returned victim waiting, the policy's order is used as it is.
"""

from __future__ import annotations

import math
import random

from radixserve.sched.kv_manager import KVManager
from radixserve.sched.policies.base import PolicyContext
from radixserve.sched.priority import PrioritySettings
from radixserve.sched.req import Req
from radixserve.sched.settings import SchedSettings


class ReturnedVictims:
    """Requests preempted or retracted back to the waiting queue, until they are admitted again."""

    def __init__(self) -> None:
        self._reqs: dict[int, Req] = {}

    def note(self, reqs: list[Req]) -> None:
        for r in reqs:
            self._reqs[id(r)] = r

    def any_waiting(self) -> bool:
        """Whether a returned victim is still waiting (it holds no request slot and is unfinished);
        forgets the others. O(victims), not O(queue)."""
        ret = self._reqs
        if ret:
            for k in [k for k, r in ret.items() if r.req_pool_idx is not None or r.finished_reason is not None]:
                del ret[k]
        return bool(ret)


def returns_to_front(max_preemptions_per_request: int, retract_victim_policy: str) -> bool:
    return max_preemptions_per_request > 0 or retract_victim_policy == "min-recompute"


def order_with_aging(
    order: list[Req], now: float, prio: PrioritySettings, rate: float, horizon: float | None, front: bool = False,
) -> list[Req]:
    """``order`` (the policy's) re-sorted as above; ``front``: returned victims go first in their class."""
    rank = prio.rank
    if not rate and horizon is None:
        if not front:
            return order
        if not prio.enabled:  # one class: a stable partition
            back = [r for r in order if not r.admitted_before]
            return order if len(back) == len(order) else [r for r in order if r.admitted_before] + back
        return sorted(order, key=lambda r: (rank(r), not r.admitted_before))

    def key(r: Req) -> tuple[int, float, int, bool]:
        t0 = now if r.queue_entry_time is None else r.queue_entry_time
        wait = now - t0
        if horizon is not None and wait >= horizon:
            return (0, t0, 0, False)
        return (1, 0.0, rank(r) - (math.floor(rate * wait) if rate else 0), not (front and r.admitted_before))

    return sorted(order, key=key)


def aged_rank(
    req: Req, now: float, prio: PrioritySettings, rate: float, horizon: float | None, use_horizon: bool = True,
) -> float:
    """The rank that priority preemption compares (lower is more important), aging included, so an
    aged request that got in is not thrown out again by the next fresh arrival of a better class:
    past the horizon a request ranks above everything; with a rate it keeps the units its time in
    the system (queued or running) earned. Without aging this is the plain priority rank.
    ``use_horizon=False`` (used for the newcomer) leaves the horizon out: passing it puts a request
    at the head of the queue but gives it no right to preempt anyone."""
    rank = prio.rank(req)
    if req.queue_entry_time is None:
        return rank
    wait = now - req.queue_entry_time
    if use_horizon and horizon is not None and wait >= horizon:
        return -math.inf
    return rank - (math.floor(rate * wait) if rate else 0)


class Ordering:
    def __init__(self, settings: SchedSettings, kv: KVManager, victims: ReturnedVictims, rng: random.Random) -> None:
        self.settings = settings
        self.kv = kv
        self.victims = victims
        self.rng = rng

    def context(self, now: float) -> PolicyContext:
        s = self.settings
        a, p = s.args, s.prio
        return PolicyContext(
            prefix_tree=self.kv.prefix_tree, now=now, rng=self.rng, prio=p,
            lpm_fallback_threshold=a.lpm_fallback_threshold,
            in_batch_check_threshold=a.in_batch_prefix_caching_check_threshold,
            in_batch_deprioritize_threshold=a.in_batch_prefix_caching_deprioritize_threshold,
        )

    def order(self, waiting: list[Req], now: float) -> list[Req]:
        """The policy's order, then aging and returned victims; marks the queue's cached prefixes."""
        s = self.settings
        a = s.args
        front = self.victims.any_waiting() and returns_to_front(a.max_preemptions_per_request, a.retract_victim_policy)
        out = order_with_aging(s.policy.order(waiting, self.context(now)), now, s.prio,
                               a.priority_aging_rate, a.priority_aging_horizon, front)
        self.kv.mark_wanted(out)  # a no-op unless --radix-eviction-policy queue-aware
        return out

    def aged_rank(self, req: Req, now: float, use_horizon: bool = True) -> float:
        a = self.settings.args
        return aged_rank(req, now, self.settings.prio, a.priority_aging_rate, a.priority_aging_horizon, use_horizon)
