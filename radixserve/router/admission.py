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
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")
NO_PRIORITY_RANK = 1 << 40  # the queue rank of a request that gives no priority (the least important)


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
class _Entry(Generic[T]):
    item: T
    rank: int
    tenant: str
    cost: float
    seq: int


class AdmissionQueue(Generic[T]):
    """The limits and the order, without the waiting: the router's ``Admission`` waits on it with
    asyncio futures, the simulator's router with its virtual clock. ``T`` is whatever stands for a
    waiter.

    Waiters are kept in one FIFO per (rank, tenant): within one the order is arrival, so the next
    waiter is the head with the smallest ``(rank, tenant counter, arrival)``, found among the
    heads (one per class) rather than among every waiter."""

    def __init__(self, limit: int, queue_size: int, tenants: TenantCounters | None = None) -> None:
        self.limit = limit  # -1: no limit
        self.queue_size = queue_size
        self.tenants = tenants
        self.in_flight = 0
        self.rejected = 0
        self._groups: dict[tuple[int, str], deque[_Entry[T]]] = {}
        self._n = 0
        self._seq = itertools.count()

    @property
    def waiting(self) -> int:
        return self._n

    def classes(self) -> list[tuple[int, str, int]]:
        """``(rank, tenant, waiters)`` for each class with waiters, in ``(rank, tenant)`` order."""
        return [(rank, tenant, len(group)) for (rank, tenant), group in sorted(self._groups.items())]

    def admit(self, item: T, rank: int = 0, tenant: str = "", cost: float = 0.0) -> str:
        """``"now"`` (a slot is free and nobody waits: taken, charged), ``"queued"`` (``item``
        waits for ``release``) or ``"rejected"`` (the queue is full: answer 429)."""
        if self.limit < 0 or (self.in_flight < self.limit and not self._n):
            self.in_flight += 1
            self._charge(tenant, cost)
            return "now"
        if self._n >= self.queue_size:
            self.rejected += 1
            return "rejected"
        if self.tenants is not None and self._n:
            self.tenants.lift(tenant, min(self.tenants.get(t) for _, t in self._groups))
        self._groups.setdefault((rank, tenant), deque()).append(_Entry(item, rank, tenant, cost, next(self._seq)))
        self._n += 1
        return "queued"

    def cancel(self, item: T) -> bool:
        """Stop waiting (a timeout, a client gone); False if ``item`` was not waiting."""
        for key, group in self._groups.items():
            for w in group:
                if w.item is item:
                    group.remove(w)
                    self._n -= 1
                    if not group:
                        del self._groups[key]
                    return True
        return False

    def release(self, alive: Callable[[T], bool] = lambda _: True) -> T | None:
        """A slot is free: hand it to the first waiter in order that is still ``alive`` (charged;
        returned: it now holds the slot), or free it (None)."""
        while self._groups:
            key = min(self._groups, key=self._order)
            group = self._groups[key]
            w = group.popleft()
            self._n -= 1
            if not group:
                del self._groups[key]
            if alive(w.item):
                self._charge(w.tenant, w.cost)
                return w.item  # the slot moves to the waiter; in_flight is unchanged
        self.in_flight -= 1
        return None

    def _order(self, key: tuple[int, str]) -> tuple[int, float, int]:
        rank, tenant = key
        head = self._groups[key][0]
        return (rank, self.tenants.get(tenant) if self.tenants is not None else 0.0, head.seq)

    def _charge(self, tenant: str, cost: float) -> None:
        if self.tenants is not None:
            self.tenants.charge(tenant, cost)


class Admission:
    """``AdmissionQueue`` for asyncio: ``acquire`` waits for a slot (at most ``timeout_s``)."""

    def __init__(self, limit: int, queue_size: int, timeout_s: float, tenants: TenantCounters | None = None) -> None:
        self.queue: AdmissionQueue[asyncio.Future[None]] = AdmissionQueue(limit, queue_size, tenants)
        self.timeout_s = timeout_s
        self.timed_out = 0

    @property
    def waiting(self) -> int:
        return self.queue.waiting

    @property
    def in_flight(self) -> int:
        return self.queue.in_flight

    @property
    def rejected(self) -> int:
        return self.queue.rejected

    async def acquire(self, rank: int = 0, tenant: str = "", cost: float = 0.0) -> bool:
        """Take a slot, waiting in the queue if need be; False means answer 429. ``cost`` is what
        the request is charged to its tenant's counter once it gets a slot."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        verdict = self.queue.admit(fut, rank, tenant, cost)
        if verdict != "queued":
            return verdict == "now"
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.timeout_s)
            return True
        except asyncio.TimeoutError:
            if fut.done():  # the slot arrived as the timer fired: keep it
                return True
            self.timed_out += 1
            return False
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # got a slot but the client left: pass it on
                self.release()
            raise
        finally:
            if not fut.done():
                fut.cancel()
                self.queue.cancel(fut)

    def release(self) -> None:
        nxt = self.queue.release(alive=lambda f: not f.done())
        if nxt is not None:
            nxt.set_result(None)
