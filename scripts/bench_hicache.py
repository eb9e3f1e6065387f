"""The KV tier (``--enable-hierarchical-cache``) against the same server without it, on an agentic
multi-turn workload whose working set is several times the KV pool, and a warm restart.

Each round starts a server (tier off, then on, alternating; a fresh tier directory each time) with
a small ``--max-total-tokens`` and runs ``bench serve --workload multi-turn --think-time``: many
conversations, each turn the whole history plus new tokens, a pause between turns while the other
conversations push the history out of the pool. Reported per setting: the prefix hit rate (cached /
prompt tokens, pool and tier together), TTFT P50 / P99, and the tier's own figures.

Warm restart: a tier server serves every conversation's first turn, is stopped (SIGTERM) and
started again over the same directory; the same first turns are sent again and their TTFT compared
with a cold server's (no tier) for the same prompts.

    python scripts/bench_hicache.py --output bench/results/<dir>/hicache.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from typing import Any

import httpx

from radixserve.bench.serving import ServingBenchmark, add_args
from radixserve.bench.subprocs import free_ports, stop_group
from radixserve.results import write_result
from radixserve.router.launch import StartFailed, wait_healthy


def serve(port: int, pool: int, tier_dir: str | None, ratio: float) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--port", str(port), "--max-total-tokens", str(pool),
           "--log-level", "warning"]
    if tier_dir is not None:
        cmd += ["--enable-hierarchical-cache", "--hicache-storage-dir", tier_dir, "--hicache-ratio", str(ratio)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_healthy({f"http://127.0.0.1:{port}": proc}, 300)
    except StartFailed as e:
        stop(proc)
        raise RuntimeError(f"{e}: {' '.join(cmd)}") from None
    return proc


def stop(proc: subprocess.Popen[bytes]) -> None:
    stop_group(proc)


def bench(port: int, a: argparse.Namespace, turns: int) -> dict[str, Any]:
    p = argparse.ArgumentParser()
    add_args(p)
    ns = p.parse_args(["--base-url", f"http://127.0.0.1:{port}", "--workload", "multi-turn",
                       "--num-prompts", str(a.conversations), "--num-turns", str(turns),
                       "--input-len", str(a.input_len), "--turn-len", str(a.turn_len), "--output-len", str(a.output_len),
                       "--think-time", str(a.think_time), "--max-concurrency", str(a.concurrency),
                       "--seed", str(a.seed), "--disable-tqdm"])
    return asyncio.run(ServingBenchmark(ns).run())


def tier_info(port: int) -> dict[str, Any] | None:
    info = httpx.get(f"http://127.0.0.1:{port}/get_server_info", timeout=30).json().get("kv_tier")
    return info[0] if info else None


def summary(rep: dict[str, Any], tier: dict[str, Any] | None) -> dict[str, Any]:
    return {"hit_rate": rep["cache_hit_rate"], "ttft_p50_ms": rep["ttft"]["p50_ms"], "ttft_p99_ms": rep["ttft"]["p99_ms"],
            "completed": rep["completed"], "prompt_tokens": rep["total_input_tokens"], "duration_s": rep["duration_s"],
            "tier_figures": {k: tier[k] for k in ("hit_tokens", "loads", "load_seconds_p50", "bytes_written", "bytes_loaded",
                                          "used_bytes", "write_errors")} if tier else None}


def rounds(a: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    for r in range(a.rounds):
        for tier_on in (False, True):
            port = free_ports(1)[0]
            tier_dir = tempfile.mkdtemp(prefix="radixserve-hicache-") if tier_on else None
            proc = serve(port, a.pool, tier_dir, a.ratio)
            try:
                rep = bench(port, a, a.turns)
                row = {"round": r, "tier": tier_on, **summary(rep, tier_info(port) if tier_on else None)}
            finally:
                stop(proc)
                if tier_dir:
                    shutil.rmtree(tier_dir, ignore_errors=True)
            print(f"round {r} tier {'on ' if tier_on else 'off'}: hit {row['hit_rate']:.1%}  TTFT p50 "
                  f"{row['ttft_p50_ms']:.0f} ms  p99 {row['ttft_p99_ms']:.0f} ms", flush=True)
            out.append(row)
    return out


def warm_restart(a: argparse.Namespace) -> dict[str, Any]:
    tier_dir = tempfile.mkdtemp(prefix="radixserve-hicache-")
    try:
        port = free_ports(1)[0]
        proc = serve(port, a.pool, tier_dir, a.ratio)
        try:
            bench(port, a, 1)  # every conversation's first turn: now in the tier
        finally:
            stop(proc)
        ttft = {}
        for name, where in (("cold", None), ("warm_restart", tier_dir)):
            port = free_ports(1)[0]
            proc = serve(port, a.pool, where, a.ratio)
            try:
                rep = bench(port, a, 1)
                ttft[name] = {"ttft_p50_ms": rep["ttft"]["p50_ms"], "ttft_mean_ms": rep["ttft"]["mean_ms"],
                              "hit_rate": rep["cache_hit_rate"]}
            finally:
                stop(proc)
        return ttft
    finally:
        shutil.rmtree(tier_dir, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pool", type=int, default=2048, help="--max-total-tokens of every server.")
    p.add_argument("--ratio", type=float, default=16.0, help="--hicache-ratio of the tier servers.")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--input-len", type=int, default=1024, help="First turn's tokens.")
    p.add_argument("--turn-len", type=int, default=64, help="New tokens per later turn.")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--think-time", type=float, default=2.0)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2, help="Rounds of (tier off, tier on).")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="Write the figures as JSON here.")
    a = p.parse_args()
    rows = rounds(a)
    on = [r for r in rows if r["tier"]]
    off = [r for r in rows if not r["tier"]]
    med = lambda rs, k: statistics.median(r[k] for r in rs)  # noqa: E731
    off_hit = med(off, "hit_rate")
    ratios = {"hit_rate": med(on, "hit_rate") / off_hit if off_hit else None,  # (None: off hit nothing)
              "ttft_p50": med(on, "ttft_p50_ms") / med(off, "ttft_p50_ms"),
              "ttft_p99": med(on, "ttft_p99_ms") / med(off, "ttft_p99_ms")}
    restart = warm_restart(a)
    restart_ratio = restart["warm_restart"]["ttft_p50_ms"] / restart["cold"]["ttft_p50_ms"]
    working_set = a.conversations * (a.input_len + (a.turns - 1) * (a.turn_len + a.output_len))
    print(f"\nworking set ~{working_set} tokens = {working_set / a.pool:.1f}x the pool ({a.pool})")
    print(f"tier on / off (medians of {a.rounds} rounds): hit rate {med(on, 'hit_rate'):.1%} / {med(off, 'hit_rate'):.1%}"
          f" = {'inf' if ratios['hit_rate'] is None else format(ratios['hit_rate'], '.2f')}x; TTFT p50 {ratios['ttft_p50']:.2f}x, p99 {ratios['ttft_p99']:.2f}x")
    print(f"warm restart: first-turn TTFT p50 {restart['warm_restart']['ttft_p50_ms']:.0f} ms vs cold "
          f"{restart['cold']['ttft_p50_ms']:.0f} ms = {restart_ratio:.2f}x")
    if a.output:
        write_result(a.output, {"args": vars(a), "host": {"cpu": platform.processor() or platform.machine(),
                                                          "cores": os.cpu_count()},
                                "working_set_tokens": working_set, "rounds": rows, "ratios": ratios,
                                "warm_restart": {**restart, "ttft_p50_ratio": restart_ratio}})


if __name__ == "__main__":
    main()
