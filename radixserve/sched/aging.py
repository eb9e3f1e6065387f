"""Aging, starvation accounting and the place of returned victims: applied to every policy's order.

``order_with_aging`` re-sorts a policy's output stably, so the policy's own order survives within
each key:

1. requests that waited ``--priority-aging-horizon`` seconds or more go first, oldest first: the
   bound (no request waits past the horizon while the engine could serve it; the adder stops at
   the first request that does not fit, so nothing younger jumps it);
2. then by priority rank minus ``floor(--priority-aging-rate * wait)``: a request gains one
   priority unit per ``1/rate`` seconds of wait (with priorities off every rank is 0, so aging
   alone orders by wait in ``1/rate``-second buckets and the policy orders within a bucket);
3. with ``--retract-victim-policy min-recompute``, requests returning from preemption/retraction
   go first within their class (they keep their place at its front).

Wait is measured from ``Req.queue_entry_time`` (set once when queued; a returned victim keeps it).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from radixserve.sched.req import Req

if TYPE_CHECKING:
    from radixserve.sched.scheduler import Scheduler


def aging_active(sched: Scheduler) -> bool:
    a = sched.args
    return bool(a.priority_aging_rate) or a.priority_aging_horizon is not None or (
        a.retract_victim_policy == "min-recompute")


def order_with_aging(sched: Scheduler, order: list[Req], now: float) -> list[Req]:
    if not aging_active(sched):
        return order
    a = sched.args
    rate, horizon = a.priority_aging_rate, a.priority_aging_horizon
    front = a.retract_victim_policy == "min-recompute"
    rank = sched.prio.rank

    def key(r: Req) -> tuple[int, float, int, int]:
        t0 = now if r.queue_entry_time is None else r.queue_entry_time
        wait = now - t0
        if horizon is not None and wait >= horizon:
            return (0, t0, 0, 0)
        return (1, 0.0, rank(r) - (math.floor(rate * wait) if rate else 0),
                0 if front and r.admitted_before else 1)

    return sorted(order, key=key)


def aged_rank(sched: Scheduler, req: Req, now: float, horizon: bool = True) -> float:
    """The rank that priority preemption compares (lower is more important), aging included, so an
    aged request that got in is not thrown out again by the next fresh arrival of a better class:
    past the horizon a request ranks above everything; with a rate it keeps the units its time in
    the system (queued or running) earned. Without aging this is the plain priority rank.
    ``horizon=False`` (used for the newcomer) leaves the horizon out: passing it puts a request at
    the head of the queue but gives it no right to preempt anyone."""
    a = sched.args
    rank = sched.prio.rank(req)
    if req.queue_entry_time is None:
        return rank
    wait = now - req.queue_entry_time
    if horizon and a.priority_aging_horizon is not None and wait >= a.priority_aging_horizon:
        return -math.inf
    return rank - (math.floor(a.priority_aging_rate * wait) if a.priority_aging_rate else 0)


def note_first_admission(sched: Scheduler, req: Req, now: float) -> None:
    """Count a request that waited past ``--starvation-threshold`` before its first admission."""
    if req.queue_entry_time is not None and now - req.queue_entry_time > sched.args.starvation_threshold:
        sched.stats.num_starved += 1
