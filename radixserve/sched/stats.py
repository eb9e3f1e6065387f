"""The scheduler's counters: ``SchedStats`` (totals and logs of recent forwards) and
``ClassCounters`` (preemptions, retractions and starved requests by priority and tenant), exported
by ``/metrics`` (``server/frontend/metrics.py``).

A class is ``(priority, tenant)`` as labels: the priority the client sent (``""`` when it sent
none, whatever default the scheduler then gave it, so the labels match the per-class histograms of
the HTTP process) and the tenant (``""`` when none). Cardinality is bounded as the histograms
bound it: the first ``MAX_CLASS_TENANTS`` tenants get their own label, later ones share
``"other"``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from radixserve.sched.req import Req

MAX_CLASS_TENANTS = 100
RECENT_STEPS = 120  # step compositions the dashboard shows (a few seconds of decoding)
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


@dataclass
class SchedStats:
    forward_steps: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    prompt_tokens: int = 0  # prompt tokens of admitted requests (first admission)
    cached_tokens: int = 0  # of which came from the prefix cache
    prefill_tokens: int = 0  # tokens actually computed in extends (recompute included)
    generated_tokens: int = 0
    num_retractions: int = 0
    num_aborted: int = 0
    num_finished: int = 0
    num_preemptions: int = 0  # running requests preempted by more important ones
    num_starved: int = 0  # first admitted after more than --starvation-threshold s of queueing
    num_deadline_rejected: int = 0  # refused by --deadline-admission
    by_class: ClassCounters = field(default_factory=ClassCounters)  # preemptions, retractions, starved by class
    # (mode name, batch size, tokens, wall seconds) of recent forwards, for benchmarks and logs
    step_log: deque[tuple[str, int, int, float]] = field(default_factory=lambda: deque(maxlen=20000))
    # (mode name, batch size, prefill tokens, decode tokens, wall seconds) of the last forwards, for
    # the dashboard: a MIXED step has both kinds. Short, so a dashboard poll copies it cheaply.
    recent_steps: deque[tuple[str, int, int, int, float]] = field(
        default_factory=lambda: deque(maxlen=RECENT_STEPS))

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def on_first_admission(self, req: Req, now: float, starvation_threshold: float) -> None:
        """A request got KV for the first time: its prompt and cache hit count, and whether it
        waited past ``--starvation-threshold`` to get there. Its ``cached_tokens`` and
        ``first_scheduled_time`` are set here, once."""
        req.admitted_before = True
        req.cached_tokens = len(req.prefix_indices)
        req.first_scheduled_time = now
        req.queue_time = now - req.arrival_time
        self.prompt_tokens += req.prompt_len
        self.cached_tokens += req.cached_tokens
        if req.queue_entry_time is not None and now - req.queue_entry_time > starvation_threshold:
            self.num_starved += 1
            self.by_class.add(req, "starved")
