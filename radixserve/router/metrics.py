"""The router's Prometheus metrics (``GET /metrics``), in a registry of its own.

Counters move on the request path; per-worker gauges (in flight, health, breaker state) are read
from the worker objects when scraped, so the request path never touches them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from radixserve.router.worker import BreakerState, Worker

_BREAKER_VALUE = {BreakerState.CLOSED: 0, BreakerState.OPEN: 1, BreakerState.HALF_OPEN: 2}


class _WorkerCollector(Collector):
    def __init__(self, workers: Callable[[], Iterable[Worker]], queued: Callable[[], int]) -> None:
        self.workers = workers
        self.queued = queued

    def collect(self) -> Iterator[GaugeMetricFamily]:
        in_flight = GaugeMetricFamily("radixserve_router_in_flight_requests",
                                      "Requests the router has sent to a target and not finished.",
                                      labels=["worker", "dp_rank"])
        healthy = GaugeMetricFamily("radixserve_router_worker_healthy", "1 when the worker passes its health checks.",
                                    labels=["worker"])
        breaker = GaugeMetricFamily("radixserve_router_circuit_breaker_state",
                                    "Circuit breaker per worker: 0 closed, 1 open, 2 half-open.", labels=["worker"])
        for w in self.workers():
            for t in w.targets:
                in_flight.add_metric([w.url, "" if t.dp_rank is None else str(t.dp_rank)], t.load)
            healthy.add_metric([w.url], 1.0 if w.health.healthy else 0.0)
            breaker.add_metric([w.url], _BREAKER_VALUE[w.breaker.state])
        queue = GaugeMetricFamily("radixserve_router_queued_requests",
                                  "Requests waiting for a slot under --max-concurrent-requests.")
        queue.add_metric([], self.queued())
        yield from (in_flight, healthy, breaker, queue)


class RouterMetrics:
    def __init__(self, workers: Callable[[], Iterable[Worker]], queued: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("radixserve_router_requests", "Requests sent to a worker, by worker and route.",
                                ["worker", "route"], registry=r)
        self.responses = Counter("radixserve_router_responses", "Requests answered, by HTTP status.",
                                 ["status"], registry=r)
        self.decisions = Counter("radixserve_router_decisions", "Routing decisions by policy and branch.",
                                 ["policy", "branch"], registry=r)
        self.retries = Counter("radixserve_router_retries", "Requests retried on another worker, by cause.",
                               ["reason"], registry=r)
        self.stream_failures = Counter(
            "radixserve_router_stream_failures", "Streams cut by their worker failing after the client had "
            "bytes (ended with an error event).", registry=r)
        self.rejected = Counter("radixserve_router_rejected", "Requests refused by the router with 429 or 503.",
                                ["reason"], registry=r)
        self.tenant_requests = Counter(
            "radixserve_router_tenant_requests", "Requests under --tenant-rate-limit-config, by tenant (a "
            "configured one, else default) and outcome (admitted, rate_limited).", ["tenant", "outcome"], registry=r)
        self.overhead = Histogram(
            "radixserve_router_overhead_seconds",
            "Time the router adds before a request leaves for its worker (parse, tokenize, route).",
            buckets=(5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1), registry=r)
        r.register(_WorkerCollector(workers, queued))

    def render(self) -> bytes:
        return generate_latest(self.registry)
