"""/metrics also speaks SGLang's and vLLM's names: the load gauges and prefix-cache counters that
their routers, autoscalers and dashboards scrape carry radixserve's values, per data-parallel rank."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from radixserve.server.frontend.metrics import FOREIGN_COUNTERS, FOREIGN_GAUGES, ServerMetrics
from radixserve.server.io_struct import SchedulerStats


def _stats(rank: int, running: int, prompt: int, cached: int) -> SchedulerStats:
    return SchedulerStats(num_running_reqs=running, num_queue_reqs=running + 3, num_used_tokens=100 * running,
                          token_usage=0.25 * running, cache_hit_rate=cached / prompt, gen_throughput=12.5,
                          prompt_tokens=prompt, cached_tokens=cached, generated_tokens=7 * running,
                          num_retractions=0, forward_steps=5, dp_rank=rank)


def _samples(m: ServerMetrics) -> dict[tuple[str, str], float]:
    return {(s.name, s.labels["dp_rank"]): s.value for fam in text_string_to_metric_families(m.render().decode())
            for s in fam.samples if "dp_rank" in s.labels and not s.name.endswith("_created")}


def test_foreign_names_carry_our_values() -> None:
    m = ServerMetrics("smol")
    m.on_scheduler_stats(_stats(0, 2, prompt=80, cached=20))
    m.on_scheduler_stats(_stats(1, 1, prompt=50, cached=10))
    m.on_scheduler_stats(_stats(0, 3, prompt=100, cached=60))  # totals grew: counters add the difference
    got = _samples(m)
    for ours, theirs in FOREIGN_GAUGES.items():
        for name in theirs:
            for rank in ("0", "1"):
                assert got[(name, rank)] == got[(f"radixserve:{ours}", rank)], (name, rank)
    assert got[("vllm:num_requests_waiting", "0")] == 6 and got[("sglang:num_running_reqs", "1")] == 1
    assert got[("vllm:prefix_cache_queries_total", "0")] == 100 and got[("vllm:prefix_cache_hits_total", "0")] == 60
    assert got[("vllm:prefix_cache_hits_total", "1")] == 10
    for attr, theirs in FOREIGN_COUNTERS.items():
        for name in theirs:
            assert got[(name + "_total", "0")] == getattr(_stats(0, 3, 100, 60), attr)
