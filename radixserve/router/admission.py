"""Backpressure at the router: at most ``--max-concurrent-requests`` in flight, a bounded queue of
waiters behind them (``--queue-size``, each waiting at most ``--queue-timeout-secs``), and a 429
for everything past that. A released slot is handed straight to a waiter, so a waiter can never
be overtaken by a newcomer.

Which waiter: the one with the smallest ``(rank, tenant counter, arrival)``. ``rank`` is the
request's priority turned into a sort key by the caller (0 for all without
``--enable-priority-scheduling``: first come, first served). The tenant counter is VTC's virtual
token counter (``--tenant-fairness``): the service each tenant got, divided by its weight; a
tenant that shows up is lifted to the smallest counter among the waiting tenants, so it neither
starves the others with a backlog of credit nor waits behind their history. Counters are read at
release time, so a tenant that was served while a waiter waited moves behind it.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field


@dataclass
class TenantCounters:
    """VTC counters: service (tokens) per tenant, divided by the tenant's weight."""

    weights: dict[str, float] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)

    def get(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)

    def lift(self, tenant: str, floor: float) -> None:
        if self.counters.get(tenant, 0.0) < floor:
            self.counters[tenant] = floor

    def charge(self, tenant: str, tokens: float) -> None:
        self.counters[tenant] = self.counters.get(tenant, 0.0) + tokens / self.weights.get(tenant, 1.0)


@dataclass(eq=False)
class _Waiter:
    fut: asyncio.Future[None]
    rank: int
    tenant: str
    cost: float
    seq: int


class Admission:
    def __init__(self, limit: int, queue_size: int, timeout_s: float, tenants: TenantCounters | None = None) -> None:
        self.limit = limit  # -1: no limit
        self.queue_size = queue_size
        self.timeout_s = timeout_s
        self.tenants = tenants
        self.in_flight = 0
        self._waiters: list[_Waiter] = []
        self._seq = itertools.count()
        self.rejected = 0
        self.timed_out = 0

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self, rank: int = 0, tenant: str = "", cost: float = 0.0) -> bool:
        """Take a slot, waiting in the queue if need be; False means answer 429. ``cost`` is what
        the request is charged to its tenant's counter once it gets a slot."""
        if self.limit < 0 or (self.in_flight < self.limit and not self._waiters):
            self.in_flight += 1
            self._charge(tenant, cost)
            return True
        if len(self._waiters) >= self.queue_size:
            self.rejected += 1
            return False
        if self.tenants is not None and self._waiters:
            self.tenants.lift(tenant, min(self.tenants.get(w.tenant) for w in self._waiters))
        w = _Waiter(asyncio.get_running_loop().create_future(), rank, tenant, cost, next(self._seq))
        self._waiters.append(w)
        try:
            await asyncio.wait_for(asyncio.shield(w.fut), self.timeout_s)
            return True
        except asyncio.TimeoutError:
            if w.fut.done():  # the slot arrived as the timer fired: keep it
                return True
            self.timed_out += 1
            return False
        except asyncio.CancelledError:
            if w.fut.done() and not w.fut.cancelled():  # got a slot but the client left: pass it on
                self.release()
            raise
        finally:
            if not w.fut.done():
                w.fut.cancel()
                self._waiters.remove(w)

    def release(self) -> None:
        while self._waiters:
            w = min(self._waiters, key=self._order)
            self._waiters.remove(w)
            if not w.fut.done():
                self._charge(w.tenant, w.cost)
                w.fut.set_result(None)  # the slot moves to the waiter; in_flight is unchanged
                return
        self.in_flight -= 1

    def _order(self, w: _Waiter) -> tuple[int, float, int]:
        return (w.rank, self.tenants.get(w.tenant) if self.tenants is not None else 0.0, w.seq)

    def _charge(self, tenant: str, cost: float) -> None:
        if self.tenants is not None:
            self.tenants.charge(tenant, cost)
