"""Aging, starvation accounting and the place of returned victims: applied to every policy's order.

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
from typing import TYPE_CHECKING

from radixserve.sched.req import Req

if TYPE_CHECKING:
    from radixserve.sched.scheduler import Scheduler


def returns_to_front(sched: Scheduler) -> bool:
    a = sched.args
    return a.max_preemptions_per_request > 0 or a.retract_victim_policy == "min-recompute"


def order_with_aging(sched: Scheduler, order: list[Req], now: float, returned: bool = False) -> list[Req]:
    """``order`` (the policy's) re-sorted as above; ``returned``: a returned victim may be waiting."""
    a = sched.args
    rate, horizon = a.priority_aging_rate, a.priority_aging_horizon
    front = returned and returns_to_front(sched)
    rank = sched.prio.rank
    if not rate and horizon is None:
        if not front:
            return order
        if not sched.prio.enabled:  # one class: a stable partition
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
        sched.stats.by_class.add(req, "starved")
