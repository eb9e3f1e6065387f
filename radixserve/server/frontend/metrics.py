"""Prometheus metrics (``--enable-metrics``), named in SGLang's style (``sglang:`` -> ``radixserve:``).

The load gauges and prefix-cache counters are also published under the names SGLang's and vLLM's
routers, autoscalers and dashboards scrape (``FOREIGN_GAUGES``, ``FOREIGN_COUNTERS``), with the
same values, so radixserve workers can stand behind them.

Gauges come from the scheduler's periodic ``SchedulerStats``; latency histograms are measured in
the HTTP process per request. Both carry a ``dp_rank`` label (the scheduler rank: 0 without
``--dp-size``) (TTFT and end-to-end from when the request was received, time per
output token over the tokens after the first, queue time as the scheduler measured it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from radixserve.sched.io import OutRow
from radixserve.server.io_struct import SchedulerStats

if TYPE_CHECKING:
    from radixserve.server.frontend.req_state import ReqState

PREFIX = "radixserve:"
# our gauge -> the same value under SGLang's and vLLM's names (vLLM's usage is a fraction, as ours)
FOREIGN_GAUGES = {
    "num_running_reqs": ("sglang:num_running_reqs", "vllm:num_requests_running"),
    "num_queue_reqs": ("sglang:num_queue_reqs", "vllm:num_requests_waiting"),
    "num_used_tokens": ("sglang:num_used_tokens",),
    "token_usage": ("sglang:token_usage", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "cache_hit_rate": ("sglang:cache_hit_rate", "vllm:gpu_prefix_cache_hit_rate"),
    "gen_throughput": ("sglang:gen_throughput",),
}
# SchedulerStats total -> counters under vLLM's names (prefix-cache queries and hits, in tokens)
FOREIGN_COUNTERS = {
    "prompt_tokens": ("vllm:prefix_cache_queries", "vllm:prompt_tokens", "sglang:prompt_tokens"),
    "cached_tokens": ("vllm:prefix_cache_hits", "sglang:cached_tokens"),
    "generated_tokens": ("vllm:generation_tokens", "sglang:generation_tokens"),
}
MAX_TENANT_LABELS = 100
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 300.0)
_TPOT_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                 0.5, 0.75, 1.0, 2.5)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.labels = {"model_name": model_name}
        names = ["model_name"]
        ranked = ["model_name", "dp_rank"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, ranked, registry=r)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, ranked, registry=r)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, ranked, buckets=buckets, registry=r)

        self.num_running_reqs = gauge("num_running_reqs", "Requests in the running batch.")
        self.num_queue_reqs = gauge("num_queue_reqs", "Requests in the waiting queue.")
        self.num_used_tokens = gauge("num_used_tokens", "KV slots held by running requests.")
        self.token_usage = gauge("token_usage", "Fraction of the KV pool held by running requests.")
        self.cache_hit_rate = gauge("cache_hit_rate", "Prefix-cache hit rate (cached / prompt tokens).")
        self.gen_throughput = gauge("gen_throughput", "Generation throughput (tokens/s).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens admitted.")
        self.cached_tokens = counter("cached_tokens", "Prompt tokens served from the prefix cache.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.num_retractions = counter("num_retracted_reqs", "Requests retracted from decode (KV ran out).")
        self.spec_draft_tokens = counter("spec_draft_tokens", "Speculative decoding: draft tokens verified.")
        self.spec_accepted_tokens = counter("spec_accepted_tokens", "Speculative decoding: draft tokens accepted.")
        self.spec_accept_rate = gauge("spec_accept_rate", "Speculative decoding: accepted / drafted tokens, since start.")
        self.spec_accept_length = gauge(
            "spec_accept_length", "Speculative decoding: tokens a request gains per verify step (accepted + 1), since start.")
        self.hicache_used_bytes = gauge("hicache_used_bytes", "KV tier: bytes of KV it holds.")
        self.hicache_hit_tokens = counter("hicache_hit_tokens", "KV tier: prompt tokens whose KV it gave back to the pool.")
        self.hicache_loads = counter("hicache_loads", "KV tier: loads of a waiting request's prefix.")
        self.hicache_load_seconds = counter("hicache_load_seconds", "KV tier: seconds from a load's start to its KV in the pool, summed.")
        self.hicache_bytes_written = counter("hicache_bytes_written", "KV tier: bytes written to its store.")
        self.hicache_bytes_loaded = counter("hicache_bytes_loaded", "KV tier: bytes loaded back into the pool.")
        self.hicache_write_errors = counter("hicache_write_errors", "KV tier: writes that failed (the KV is computed again when needed).")
        self.num_requests = Counter(PREFIX + "num_requests", "Requests received.", names, registry=r)
        self.num_aborted = counter("num_aborted_requests", "Requests finished with an abort.")
        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.tpot = hist("time_per_output_token_seconds", "Time per output token after the first.", _TPOT_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency.", _LATENCY_BUCKETS)
        self.queue_time = hist("queue_time_seconds", "Time in the waiting queue before first scheduled.",
                               _LATENCY_BUCKETS)
        # per-class latency and counters (labels priority and tenant; at most
        # MAX_TENANT_LABELS tenants get their own label, the rest share "other"), and the global
        # preemption / starvation / deadline counters
        cls_names = [*names, "priority", "tenant"]
        self.queue_time_by_class = Histogram(
            PREFIX + "queue_time_by_class_seconds", "Queue time by priority and tenant.", cls_names,
            buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft_by_class = Histogram(
            PREFIX + "time_to_first_token_by_class_seconds", "Time to first token by priority and tenant.",
            cls_names, buckets=_LATENCY_BUCKETS, registry=r)
        self.num_preemptions = counter("num_preempted_reqs", "Running requests preempted by more important ones.")
        self.num_starved = counter(
            "num_starved_reqs", "Requests first scheduled after more than --starvation-threshold s of queueing.")
        self.num_deadline_rejected = counter(
            "num_deadline_rejected_reqs", "Requests refused by --deadline-admission (deadline_unmeetable).")
        # the same counters by class, from the scheduler's per-class totals (sched/stats.py)
        self.num_preemptions_by_class = Counter(
            PREFIX + "num_preempted_reqs_by_class", "Running requests preempted, by priority and tenant.",
            cls_names, registry=r)
        self.num_retractions_by_class = Counter(
            PREFIX + "num_retracted_reqs_by_class", "Requests retracted from decode, by priority and tenant.",
            cls_names, registry=r)
        self.num_starved_by_class = Counter(
            PREFIX + "num_starved_reqs_by_class", "Starved requests (see num_starved_reqs), by priority and tenant.",
            cls_names, registry=r)
        self.foreign_gauges = {ours: [Gauge(name, f"{name}: radixserve:{ours} under this name.", ranked, registry=r)
                                      for name in theirs] for ours, theirs in FOREIGN_GAUGES.items()}
        self.foreign_counters = {
            attr: [Counter(name, f"{name}: radixserve's {attr} under this name.", ranked, registry=r)
                   for name in theirs] for attr, theirs in FOREIGN_COUNTERS.items()}
        self._tenants: set[str] = set()
        self._last: dict[int, SchedulerStats] = {}  # per data-parallel rank
        self._last_by_class: dict[tuple[int, str, str], tuple[int, int, int]] = {}  # per (rank, class)

    def on_scheduler_stats(self, s: SchedulerStats) -> None:
        lb = {**self.labels, "dp_rank": str(s.dp_rank)}
        self.num_running_reqs.labels(**lb).set(s.num_running_reqs)
        self.num_queue_reqs.labels(**lb).set(s.num_queue_reqs)
        self.num_used_tokens.labels(**lb).set(s.num_used_tokens)
        self.token_usage.labels(**lb).set(s.token_usage)
        self.cache_hit_rate.labels(**lb).set(s.cache_hit_rate)
        self.gen_throughput.labels(**lb).set(s.gen_throughput)
        self.hicache_used_bytes.labels(**lb).set(s.hicache_used_bytes)
        if s.spec_verify_rows:
            self.spec_accept_rate.labels(**lb).set(s.spec_accepted_tokens / max(s.spec_draft_tokens, 1))
            self.spec_accept_length.labels(**lb).set((s.spec_verify_rows + s.spec_accepted_tokens) / s.spec_verify_rows)
        for ours, gauges in self.foreign_gauges.items():
            for g in gauges:
                g.labels(**lb).set(getattr(s, ours))
        prev = self._last.get(s.dp_rank)
        for counter, attr in ((self.prompt_tokens, "prompt_tokens"), (self.cached_tokens, "cached_tokens"),
                              (self.generation_tokens, "generated_tokens"), (self.num_retractions, "num_retractions"),
                              (self.num_preemptions, "num_preemptions"), (self.num_starved, "num_starved"),
                              (self.num_deadline_rejected, "num_deadline_rejected"),
                              (self.spec_draft_tokens, "spec_draft_tokens"),
                              (self.spec_accepted_tokens, "spec_accepted_tokens"),
                              (self.hicache_hit_tokens, "hicache_hit_tokens"), (self.hicache_loads, "hicache_loads"),
                              (self.hicache_load_seconds, "hicache_load_seconds"),
                              (self.hicache_bytes_written, "hicache_bytes_written"),
                              (self.hicache_bytes_loaded, "hicache_bytes_loaded"),
                              (self.hicache_write_errors, "hicache_write_errors")):
            delta = getattr(s, attr) - (getattr(prev, attr) if prev is not None else 0)
            if delta > 0:
                for c in (counter, *self.foreign_counters.get(attr, ())):
                    c.labels(**lb).inc(delta)
        self._last[s.dp_rank] = s
        by_class = (self.num_preemptions_by_class, self.num_retractions_by_class, self.num_starved_by_class)
        for priority, tenant, *counts in s.by_class:
            before = self._last_by_class.get((s.dp_rank, priority, tenant), (0, 0, 0))
            cls = {**self.labels, "priority": priority, "tenant": self._tenant(tenant)}
            for counter, now_n, prev_n in zip(by_class, counts, before, strict=True):
                if now_n > prev_n:
                    counter.labels(**cls).inc(now_n - prev_n)
            self._last_by_class[(s.dp_rank, priority, tenant)] = (counts[0], counts[1], counts[2])

    def on_request_finished(self, st: ReqState, last: OutRow, now: float) -> None:
        lb = {**self.labels, "dp_rank": str(last.dp_rank)}
        e2e = now - st.created
        self.e2e.labels(**lb).observe(e2e)
        self.queue_time.labels(**lb).observe(last.queue_time)
        if last.finished_reason is not None and last.finished_reason.is_abort:
            self.num_aborted.labels(**lb).inc()
        cls = {**self.labels, "priority": "" if st.priority is None else str(st.priority),
               "tenant": self._tenant(st.tenant)}
        self.queue_time_by_class.labels(**cls).observe(last.queue_time)
        ttft = st.ttft
        if ttft is not None:
            self.ttft_by_class.labels(**cls).observe(ttft)
            self.ttft.labels(**lb).observe(ttft)
            n = last.completion_tokens
            if n > 1:
                self.tpot.labels(**lb).observe((e2e - ttft) / (n - 1))

    def _tenant(self, tenant: str | None) -> str:
        t = tenant or ""
        if t in self._tenants:
            return t
        if len(self._tenants) < MAX_TENANT_LABELS:
            self._tenants.add(t)
            return t
        return "other"

    def render(self) -> bytes:
        return generate_latest(self.registry)
