"""Per-class counters: preemptions, retractions and starved requests by priority and
tenant, kept by the scheduler and exported by ``/metrics`` (``server/metrics.py``).

A class is ``(priority, tenant)`` as labels: the priority the client sent (``""`` when it sent
none, whatever default the scheduler then gave it, so the labels match the per-class histograms of
the HTTP process) and the tenant (``""`` when none). Cardinality is bounded as the histograms
bound it: the first ``MAX_CLASS_TENANTS`` tenants get their own label, later ones share
``"other"``.
"""

from __future__ import annotations

from typing import Literal

from radixserve.sched.req import Req

MAX_CLASS_TENANTS = 100
FIELDS = ("preemptions", "retractions", "starved")
Field = Literal["preemptions", "retractions", "starved"]
_INDEX = {f: i for i, f in enumerate(FIELDS)}


class ClassCounters:
    def __init__(self, max_tenants: int = MAX_CLASS_TENANTS) -> None:
        self.max_tenants = max_tenants
        self.counts: dict[tuple[str, str], list[int]] = {}
        self._tenants: set[str] = set()

    def key(self, req: Req) -> tuple[str, str]:
        p = req.requested_priority
        tenant = req.tenant or ""
        if tenant not in self._tenants:
            if len(self._tenants) < self.max_tenants:
                self._tenants.add(tenant)
            else:
                tenant = "other"
        return ("" if p is None else str(p), tenant)

    def add(self, req: Req, what: Field, n: int = 1) -> None:
        k = self.key(req)
        row = self.counts.get(k)
        if row is None:
            row = self.counts[k] = [0] * len(FIELDS)
        row[_INDEX[what]] += n

    def get(self, priority: str, tenant: str) -> dict[str, int]:
        row = self.counts.get((priority, tenant), [0] * len(FIELDS))
        return dict(zip(FIELDS, row, strict=True))

    def rows(self) -> list[tuple[str, str, int, int, int]]:
        """Cumulative ``(priority, tenant, preemptions, retractions, starved)`` per class seen."""
        return [(p, t, c[0], c[1], c[2]) for (p, t), c in sorted(self.counts.items())]
