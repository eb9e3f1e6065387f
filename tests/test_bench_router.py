"""``radixserve bench router`` end to end on tiny settings (stub workers, one router), checked through
its JSON; no timing thresholds (the host is shared). Also bench serve's cache hit rate, which the
real-workers mode reports per policy."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from radixserve.bench.router_bench_common import BENCH_SERVE_DEFAULTS, _policies
from radixserve.bench.router_bench_real import _serve_namespace, launch_command
from radixserve.bench.serving import RequestResult, ServingBenchmark
from radixserve.cli import build_parser, main


def _assert_load(res: dict[str, Any], router: bool) -> None:
    assert res["requests"] > 0 and res["errors"] == {}
    assert res["requests_per_s"] > 0 and res["wall_s"] > 0
    assert res["client_cpu_s"] >= 0 and res["stubs_cpu_s"] >= 0
    if router:
        assert res["router_cpu_s"] >= 0
        per = res["requests_per_router_cpu_s"]
        assert per is None or per > 0  # None only if the router used less than one clock tick


@pytest.mark.slow
def test_bench_router_stub_run_reports_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "router.json"
    code = main(["bench", "router", "--requests", "30", "--block", "5", "--duration", "0.5", "--concurrency", "4",
                 "--num-stub-workers", "2", "--policy", "cache_aware", "--prompt-chars", "64",
                 "--router-arg=--max-concurrent-requests=16", "--disable-tqdm", "--output", str(out)])
    assert code == 0
    rep = json.loads(out.read_text())
    assert rep["mode"] == "stubs" and rep["settings"]["router_args"] == ["--max-concurrent-requests=16"]
    _assert_load(rep["direct_throughput"], router=False)
    assert list(rep["policies"]) == ["cache_aware"]
    res = rep["policies"]["cache_aware"]
    lat = res["latency"]
    assert lat["errors"] == {}
    for side in ("direct", "routed"):
        s = lat[side]
        assert s["n"] == 30
        assert 0 <= s["p50_ms"] <= s["p99_ms"]
    assert lat["added_p50_ms"] == lat["routed"]["p50_ms"] - lat["direct"]["p50_ms"]
    _assert_load(res["throughput"], router=True)
    _assert_load(res["streaming"], router=True)
    # the router saw every routed request: warm-up + latency samples + both load phases (and the
    # in-flight tails after each window, hence >=), spread over the two stubs
    routed = sum(res["router_metrics"]["requests_per_worker"].values())
    assert routed >= 30 + res["throughput"]["requests"] + res["streaming"]["requests"]
    assert len(res["router_metrics"]["requests_per_worker"]) == 2
    assert set(res["router_metrics"]["decisions"]) <= {"cache_hit", "cache_miss", "balance", "balance_affinity"}


def test_bench_router_refuses_bad_options_before_starting_anything(capsys: Any) -> None:
    assert main(["bench", "router", "--compare-policies", "cache_aware,nope", "--disable-tqdm"]) == 1
    assert "nope" in capsys.readouterr().err
    assert main(["bench", "router", "--duration", "0", "--concurrency", "0", "--disable-tqdm"]) == 1
    err = capsys.readouterr().err
    assert "--duration" in err and "--concurrency" in err


def test_real_workers_mode_passes_bench_serve_options_through() -> None:
    ns = build_parser().parse_args(["bench", "router", "--real-workers", "2",
                                    "--bench-serve-arg", "--num-prompts 4 --output-len 8"])
    sns = _serve_namespace(ns, "http://127.0.0.1:1")
    assert sns.workload == "multi-turn" and sns.base_url == "http://127.0.0.1:1"
    assert (sns.num_prompts, sns.output_len) == (4, 8)  # the user's options win over the defaults
    assert sns.num_turns == int(BENCH_SERVE_DEFAULTS[BENCH_SERVE_DEFAULTS.index("--num-turns") + 1])


def test_bench_serve_reports_the_cache_hit_rate_of_the_requests_that_tell() -> None:
    ns = argparse.Namespace(base_url="http://x", api_key=None, workload="multi-turn", request_rate=float("inf"),
                            max_concurrency=None)
    results = [RequestResult(True, 100, output_tokens=4, e2e=1.0, cached_tokens=60),
               RequestResult(True, 50, output_tokens=4, e2e=1.0, cached_tokens=0),
               RequestResult(True, 30, output_tokens=4, e2e=1.0),  # this server said nothing: left out
               RequestResult(False, 70, error="boom")]
    rep = ServingBenchmark(ns).report("m", results, 2.0)
    assert rep["total_cached_tokens"] == 60 and rep["cache_hit_rate"] == 60 / 150
    rep = ServingBenchmark(ns).report("m", results[2:], 2.0)
    assert rep["total_cached_tokens"] is None and rep["cache_hit_rate"] is None


def test_real_workers_mode_runs_a_policy_with_and_without_cache_events(capsys: Any) -> None:
    ns = build_parser().parse_args(["bench", "router", "--real-workers", "2",
                                    "--compare-policies", "cache_aware,cache_aware+events"])
    plain, events = (launch_command(ns, p, 40000) for p in _policies(ns))
    assert "--enable-cache-events" not in plain and plain[plain.index("--policy") + 1] == "cache_aware"
    assert events[events.index("--policy") + 1] == "cache_aware"
    i = events.index("--cache-events-port")
    assert not 40000 <= int(events[i + 1]) <= 40002 and "--enable-cache-events" in events
    assert events[events.index("--prefix-match") + 1] == "tokens"
    # against stub workers there are no caches to follow
    assert main(["bench", "router", "--compare-policies", "cache_aware+events", "--disable-tqdm"]) == 1
    err = capsys.readouterr().err
    assert "unknown cache_aware+events" in err and "Traceback" not in err  # refused before starting stubs
