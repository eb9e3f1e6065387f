"""``radixserve bench router --real-workers N``: what a routing policy buys on real workers.

For each policy (and each of ``--rounds``), ``radixserve launch`` starts N fresh workers and the
router, so no run inherits a warm cache, and ``radixserve bench serve`` runs against the router;
reported per policy: the prefix-cache hit rate (cached / prompt tokens), TTFT, and where the
router sent the requests (from its ``/metrics``). The stub-worker mode is ``router_bench``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import time
from typing import Any

from radixserve.bench.router_bench_common import (
    BENCH_SERVE_DEFAULTS,
    _f,
    _machine,
    _policies,
    _split_args,
    router_counts,
)
from radixserve.bench.subprocs import LAUNCH_STOP_S, Procs, free_ports, wait_healthy


def _serve_namespace(ns: argparse.Namespace, base_url: str) -> argparse.Namespace:
    from radixserve.bench.serving import add_args as serve_args

    p = argparse.ArgumentParser(prog="bench serve")
    serve_args(p)
    sns = p.parse_args(["--workload", ns.workload, *BENCH_SERVE_DEFAULTS, *_split_args(ns.bench_serve_arg)])
    sns.base_url = base_url
    sns.disable_tqdm = sns.disable_tqdm or ns.disable_tqdm
    return sns


def launch_command(ns: argparse.Namespace, policy: str, port: int) -> list[str]:
    """``radixserve launch`` for one run: ``policy`` is a policy name, or ``NAME+events``, where the
    workers publish their cache events and the router's tree follows them (by token)."""
    n = ns.real_workers
    base, events = policy.removesuffix("+events"), policy.endswith("+events")
    follow = []
    if events:
        ev = free_ports(n, consecutive=True)[0]
        while ev <= port + n and port <= ev + n:  # not the HTTP ports' block, which nothing binds yet
            ev = free_ports(n, consecutive=True)[0]
        follow = ["--cache-events-port", str(ev), "--enable-cache-events", "--prefix-match", "tokens"]
    return [sys.executable, "-m", "radixserve.cli", "launch", "--num-workers", str(n), "--port", str(port),
            "--policy", base, "--log-level", "warning", "--max-total-tokens", str(ns.max_total_tokens),
            *_split_args(ns.launch_arg), *_split_args(ns.router_arg), *follow]


async def _real_once(ns: argparse.Namespace, procs: Procs, policy: str, rnd: int) -> dict[str, Any]:
    import aiohttp

    from radixserve.bench.serving import ServingBenchmark

    n = ns.real_workers
    port = ns.port or free_ports(n + 1, consecutive=True)[0]
    name = f"launch-{policy}-{rnd}"
    cmd = launch_command(ns, policy, port)
    url = f"http://127.0.0.1:{port}"
    print(f"[bench router] {policy} (round {rnd + 1}): starting {n} workers: {shlex.join(cmd[2:])}", file=sys.stderr)
    proc = procs.start(name, cmd)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            t0 = time.monotonic()
            await wait_healthy(session, url, proc, name, procs, ns.startup_timeout)
            startup = time.monotonic() - t0
            rep = await ServingBenchmark(_serve_namespace(ns, url)).run()
            counts = await router_counts(session, url)
    finally:
        procs.stop(proc, signal.SIGINT, LAUNCH_STOP_S)
    return {"policy": policy, "round": rnd, "startup_s": startup, "completed": rep["completed"],
            "failed": rep["failed"], "errors": rep["errors"], "duration_s": rep["duration_s"],
            "cache_hit_rate": rep.get("cache_hit_rate"), "total_cached_tokens": rep.get("total_cached_tokens"),
            "total_input_tokens": rep["total_input_tokens"], "output_throughput": rep["output_throughput"],
            "ttft": rep["ttft"], "e2e_latency": rep["e2e_latency"], **counts}


async def run_real(ns: argparse.Namespace, procs: Procs) -> dict[str, Any]:
    policies = _policies(ns)
    runs = []
    for rnd in range(ns.rounds):
        for policy in policies:
            runs.append(await _real_once(ns, procs, policy, rnd))
    summary: dict[str, dict[str, float | None]] = {}
    for policy in policies:
        mine = [r for r in runs if r["policy"] == policy]
        cached = sum(r["total_cached_tokens"] or 0 for r in mine)
        prompt = sum(r["total_input_tokens"] for r in mine)
        ttfts = [r["ttft"]["p50_ms"] for r in mine if r["ttft"]["p50_ms"] is not None]
        summary[policy] = {"cache_hit_rate": cached / prompt if prompt else None,
                           "ttft_p50_ms": sum(ttfts) / len(ttfts) if ttfts else None}
    return {"mode": "real-workers", "machine": _machine(), "num_workers": ns.real_workers,
            "bench_serve_args": ["--workload", ns.workload, *BENCH_SERVE_DEFAULTS, *_split_args(ns.bench_serve_arg)],
            "max_total_tokens": ns.max_total_tokens, "runs": runs, "summary": summary}


def print_real_report(rep: dict[str, Any]) -> None:
    print(f"{' Router Benchmark (' + str(rep['num_workers']) + ' real workers) ':=^86}")
    print(f"{'policy':<14}{'round':>6}{'hit rate':>10}{'TTFT P50':>11}{'TTFT P99':>11}{'E2E P50':>11}"
          f"{'out tok/s':>11}{'failed':>8}")
    for r in rep["runs"]:
        hit = r["cache_hit_rate"]
        print(f"{r['policy']:<14}{r['round'] + 1:>6}{(f'{hit:.1%}' if hit is not None else '-'):>10}"
              f"{_f(r['ttft']['p50_ms'], 0):>11}{_f(r['ttft']['p99_ms'], 0):>11}{_f(r['e2e_latency']['p50_ms'], 0):>11}"
              f"{_f(r['output_throughput'], 1):>11}{r['failed']:>8}")
        if r.get("requests_per_worker"):
            spread = " ".join(f"{u.rsplit(':', 1)[1]}:{c}" for u, c in sorted(r["requests_per_worker"].items()))
            print(f"{'':<14}requests per worker port: {spread}; decisions: {json.dumps(r.get('decisions', {}))}")
    print("=" * 86)
