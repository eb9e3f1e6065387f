"""Workers as the router sees them: health, a circuit breaker, and their routing targets.

Pure state machines (the caller passes ``now``), so they are tested without sleeping:

Health (``--health-failure-threshold`` 3, ``--health-success-threshold`` 2):

    healthy ──(failure_threshold checks fail in a row)──> unhealthy ──(success_threshold pass)──> healthy

Circuit breaker, per worker, on request outcomes (``--cb-failure-threshold`` 5,
``--cb-success-threshold`` 2, ``--cb-timeout-duration-secs`` 30):

    closed ──(failure_threshold failures in a row)──> open ──(timeout elapsed)──> half_open
    half_open ──(success_threshold successes)──> closed        half_open ──(a failure)──> open

Open lets nothing through; half-open lets one probe request at a time. A failure is a connection
error, a timeout or a 5xx; a 4xx is the client's fault and a 429 is the worker being full, so
neither counts against the worker.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from radixserve.router.policy import Target


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass
class CircuitBreaker:
    failure_threshold: int = 5
    success_threshold: int = 2
    timeout_s: float = 30.0
    state: BreakerState = BreakerState.CLOSED
    failures: int = 0
    successes: int = 0
    opened_at: float = 0.0
    probing: bool = False  # half-open: a probe request is out

    def allow(self, now: float) -> bool:
        """May a request go to this worker now? (Does not reserve the half-open probe.)"""
        if self.state is BreakerState.OPEN and now - self.opened_at >= self.timeout_s:
            self.state, self.successes, self.probing = BreakerState.HALF_OPEN, 0, False
        if self.state is BreakerState.OPEN:
            return False
        return not (self.state is BreakerState.HALF_OPEN and self.probing)

    def on_send(self) -> None:
        if self.state is BreakerState.HALF_OPEN:
            self.probing = True

    def record_success(self) -> None:
        self.failures = 0
        if self.state is BreakerState.HALF_OPEN:
            self.probing = False
            self.successes += 1
            if self.successes >= self.success_threshold:
                self.state, self.successes = BreakerState.CLOSED, 0

    def record_failure(self, now: float) -> None:
        self.probing = False
        if self.state is BreakerState.HALF_OPEN:
            self._open(now)
            return
        self.failures += 1
        if self.failure_threshold > 0 and self.failures >= self.failure_threshold:
            self._open(now)

    def reset(self) -> None:
        self.state, self.failures, self.successes, self.probing = BreakerState.CLOSED, 0, 0, False

    def _open(self, now: float) -> None:
        self.state, self.opened_at, self.failures, self.successes = BreakerState.OPEN, now, 0, 0


@dataclass
class Health:
    failure_threshold: int = 3
    success_threshold: int = 2
    healthy: bool = True
    fails: int = 0
    passes: int = 0

    def record(self, ok: bool) -> bool:
        """Record one check; returns True when the healthy flag changed."""
        before = self.healthy
        if ok:
            self.fails, self.passes = 0, self.passes + 1
            if not self.healthy and self.passes >= self.success_threshold:
                self.healthy = True
        else:
            self.passes, self.fails = 0, self.fails + 1
            if self.healthy and self.fails >= self.failure_threshold:
                self.healthy = False
        return before != self.healthy

    def eject(self) -> None:
        """Unhealthy now, as after ``failure_threshold`` failed checks (the process is known gone)."""
        self.healthy, self.passes, self.fails = False, 0, self.failure_threshold


@dataclass(eq=False)
class Worker:
    """One ``radixserve serve`` (or any SGLang-compatible server) behind the router."""

    url: str
    health: Health
    breaker: CircuitBreaker
    dp_size: int = 1
    targets: list[Target] = field(default_factory=list)
    model_path: str | None = None
    cache_events_endpoint: str | None = None
    kv_events_endpoint: str | None = None  # its vLLM-schema KV events (--kv-events-config)
    role: str | None = None  # PD: "prefill" or "decode"
    bootstrap_port: int | None = None  # PD prefill worker: where decode workers register a room

    def make_targets(self, dp_aware: bool) -> None:
        if dp_aware:
            self.targets = [Target(self.url, r) for r in range(self.dp_size)]
        else:
            self.targets = [Target(self.url)]

    def eligible(self, now: float) -> bool:
        return self.health.healthy and self.breaker.allow(now)

    @property
    def load(self) -> int:
        return sum(t.load for t in self.targets)
