"""The stub-workers mode of ``radixserve bench router`` (``router_bench``'s docstring says what it
measures): stub workers and one router per policy as subprocesses, latency through the router
against straight to a stub, throughput and the router's CPU per request."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import string
import sys
import time
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import aiohttp
    from tqdm import tqdm

from radixserve.bench.router_bench_common import (
    _f,
    _machine,
    _policies,
    _split_args,
    router_counts,
)
from radixserve.bench.subprocs import (
    BenchError,
    Procs,
    cpu_seconds,
    free_ports,
    pin,
    self_cpu_seconds,
    wait_healthy,
)

# NOTE: aiohttp, tqdm and bench.serving are imported where they are used: the CLI imports this
# module to build its parser, and every radixserve command would pay for them otherwise.

STUB_START_S = 30.0


ROUTER_START_S = 60.0


WARMUP_REQUESTS = 50


THROUGHPUT_WARMUP_S = 0.5


def router_command(urls: Sequence[str], port: int, policy: str, extra: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "radixserve.cli", "router", "--worker-urls", *urls, "--port", str(port),
            "--policy", policy, "--log-level", "warning", *extra]


def make_bodies(n: int, prompt_chars: int, num_prefixes: int, stream: bool, seed: int = 0,
                users: int = 0) -> list[bytes]:
    """``users``: each body names one of that many users (the OpenAI ``user`` field, for session
    affinity and tenant limits at the router); 0: none."""
    rng = random.Random(seed)
    alphabet = string.ascii_lowercase + " "
    prefix_len = prompt_chars * 3 // 4
    prefixes = ["".join(rng.choices(alphabet, k=prefix_len)) for _ in range(max(1, num_prefixes))]
    out = []
    for i in range(n):
        text = prefixes[i % len(prefixes)] + "".join(rng.choices(alphabet, k=prompt_chars - prefix_len))
        body: dict[str, Any] = {"text": text, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
        if stream:
            body["stream"] = True
        if users:
            body["user"] = f"user-{i % users}"
        out.append(json.dumps(body).encode())
    return out


_HEADERS = {"Content-Type": "application/json"}


async def send(session: aiohttp.ClientSession, url: str, body: bytes, stream: bool) -> str | None:
    """One request, its answer read to the end; None when it went well, else what went wrong."""
    import aiohttp

    try:
        async with session.post(url, data=body, headers=_HEADERS) as r:
            if not stream:
                await r.read()
                return None if r.status == 200 else f"HTTP {r.status}"
            tail = b""
            async for chunk in r.content.iter_any():
                tail = (tail + chunk)[-16:]
            if r.status != 200:
                return f"HTTP {r.status}"
            return None if tail.endswith(b"[DONE]\n\n") else "stream ended without [DONE]"
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return type(e).__name__


def _stats(xs: list[float]) -> dict[str, float | int | None]:
    from radixserve.bench.serving import percentile

    ms = [x * 1e3 for x in xs]
    return {"n": len(ms), "mean_ms": sum(ms) / len(ms) if ms else None, "p50_ms": percentile(ms, 50),
            "p90_ms": percentile(ms, 90), "p99_ms": percentile(ms, 99)}


async def measure_latency(session: aiohttp.ClientSession, direct: Sequence[str], routed: str, bodies: list[bytes],
                          n: int, block: int, bar: tqdm[Any]) -> dict[str, Any]:
    """``n`` sequential calls per side, in blocks of ``block``, the side that goes first flipping
    every round (ABBA), after ``WARMUP_REQUESTS`` unrecorded calls per side."""
    samples: dict[str, list[float]] = {"direct": [], "routed": []}
    errors: Counter[str] = Counter()
    i = 0

    async def one(side: str, record: bool) -> None:
        nonlocal i
        url = routed if side == "routed" else direct[i % len(direct)]
        body = bodies[i % len(bodies)]
        i += 1
        t0 = time.perf_counter()
        err = await send(session, url, body, stream=False)
        dt = time.perf_counter() - t0
        if err is not None:
            errors[f"{side}: {err}"] += 1
        elif record:
            samples[side].append(dt)
            bar.update(1)

    for _ in range(min(WARMUP_REQUESTS, n)):
        await one("direct", False)
        await one("routed", False)
    first = True
    while len(samples["direct"]) < n or len(samples["routed"]) < n:
        for side in ("direct", "routed") if first else ("routed", "direct"):
            for _ in range(min(block, n - len(samples[side]))):
                await one(side, True)
        first = not first
        if sum(errors.values()) > n:
            break  # something is broken: report what there is
    d, r = _stats(samples["direct"]), _stats(samples["routed"])

    def diff(key: str) -> float | None:
        a, b = r[key], d[key]
        return float(a) - float(b) if a is not None and b is not None else None

    return {"direct": d, "routed": r, "added_p50_ms": diff("p50_ms"), "added_p99_ms": diff("p99_ms"),
            "added_mean_ms": diff("mean_ms"), "errors": dict(errors)}


async def measure_throughput(session: aiohttp.ClientSession, urls: Sequence[str], bodies: list[bytes],
                             concurrency: int, duration: float, stream: bool, watched: dict[str, list[int]],
                             bar: tqdm[Any]) -> dict[str, Any]:
    """``concurrency`` requests in flight for ``duration`` s (after a warm-up); the CPU seconds of
    each ``watched`` group of processes and of this one over exactly the measured window."""
    done = 0
    errors: Counter[str] = Counter()
    measuring = False
    stop = False

    async def loop(k: int) -> None:
        nonlocal done
        i = k
        while not stop:
            err = await send(session, urls[i % len(urls)], bodies[i % len(bodies)], stream)
            i += concurrency
            if measuring:
                if err is None:
                    done += 1
                else:
                    errors[err] += 1

    def cpu() -> dict[str, float]:
        out = {name: sum(cpu_seconds(p) for p in pids) for name, pids in watched.items()}
        out["client"] = self_cpu_seconds()
        return out

    tasks = [asyncio.create_task(loop(k)) for k in range(concurrency)]
    try:
        await asyncio.sleep(THROUGHPUT_WARMUP_S)
        cpu0, t0 = cpu(), time.perf_counter()
        measuring = True
        while (elapsed := time.perf_counter() - t0) < duration:
            bar.n = round(elapsed, 1)
            bar.refresh()
            await asyncio.sleep(min(0.25, duration - elapsed))
        measuring = False
        cpu1, wall = cpu(), time.perf_counter() - t0
    finally:
        stop = True
        await asyncio.gather(*tasks, return_exceptions=True)
    out: dict[str, Any] = {"requests": done, "errors": dict(errors), "wall_s": wall,
                           "requests_per_s": done / wall if wall else 0.0}
    for name in cpu0:
        used = cpu1[name] - cpu0[name]
        out[f"{name}_cpu_s"] = used
        out[f"{name}_cpu_util"] = used / wall if wall else 0.0
        out[f"{name}_cpu_ms_per_request"] = used / done * 1e3 if done else None
    if "router" in watched:
        used = out["router_cpu_s"]
        out["requests_per_router_cpu_s"] = done / used if used > 0 else None
    return out


def _cpu_split(no_pin: bool) -> tuple[set[int], set[int]] | None:
    """(the router's core, everyone else's), or None when there is one core or pinning is off."""
    cores = sorted(os.sched_getaffinity(0))
    if no_pin or len(cores) < 2:
        return None
    return {cores[-1]}, set(cores[:-1])


async def run_stubs(ns: argparse.Namespace, procs: Procs) -> dict[str, Any]:
    import aiohttp

    policies = _policies(ns)
    split = _cpu_split(ns.no_pin)
    own = os.sched_getaffinity(0)
    ports = free_ports(ns.num_stub_workers + 1)
    router_port = ns.port or ports[0]
    stub_urls = [f"http://127.0.0.1:{p}" for p in ports[1:]]
    stubs = [procs.start(f"stub-{p}", [sys.executable, "-m", "radixserve.bench.stub_worker", "--port", str(p),
                                        "--stream-chunks", str(ns.stream_chunks)]) for p in ports[1:]]
    bodies = make_bodies(256, ns.prompt_chars, ns.num_prefixes, stream=False, users=ns.users)
    sbodies = make_bodies(256, ns.prompt_chars, ns.num_prefixes, stream=True, users=ns.users)
    router_extra = _split_args(ns.router_arg)
    # A connector per phase would measure connection set-up; one keep-alive pool serves them all.
    connector = aiohttp.TCPConnector(limit=max(ns.concurrency, 1), keepalive_timeout=30.0)
    report: dict[str, Any] = {
        "mode": "stubs", "machine": _machine(),
        "settings": {k: getattr(ns, k) for k in ("num_stub_workers", "requests", "block", "duration", "concurrency",
                                                  "prompt_chars", "num_prefixes", "stream_chunks", "users")}
        | {"router_args": router_extra},
        "pinned": {"router": sorted(split[0]), "stubs_and_client": sorted(split[1])} if split else None,
        "policies": {},
    }
    try:
        if split:
            os.sched_setaffinity(0, split[1])
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
            for url, proc in zip(stub_urls, stubs, strict=True):
                await wait_healthy(session, url, proc, f"stub-{url.rsplit(':', 1)[1]}", procs, STUB_START_S)
                if split:
                    pin(proc.pid, split[1])
            stub_pids = [p.pid for p in stubs]
            with _bar(ns, ns.duration, "direct throughput", "s") as bar:
                report["direct_throughput"] = await measure_throughput(
                    session, [f"{u}/generate" for u in stub_urls], bodies, ns.concurrency, ns.duration, False,
                    {"stubs": stub_pids}, bar)
            for policy in policies:
                name = f"router-{policy}"
                router = procs.start(name, router_command(stub_urls, router_port, policy, router_extra))
                rurl = f"http://127.0.0.1:{router_port}"
                try:
                    await wait_healthy(session, rurl, router, name, procs, ROUTER_START_S)
                    if split:
                        pin(router.pid, split[0])
                    res: dict[str, Any] = {}
                    with _bar(ns, 2 * ns.requests, f"{policy}: latency", "req") as bar:
                        res["latency"] = await measure_latency(
                            session, [f"{u}/generate" for u in stub_urls], f"{rurl}/generate", bodies,
                            ns.requests, ns.block, bar)
                    watched = {"router": [router.pid], "stubs": stub_pids}
                    for key, b, stream in (("throughput", bodies, False), ("streaming", sbodies, True)):
                        with _bar(ns, ns.duration, f"{policy}: {key}", "s") as bar:
                            res[key] = await measure_throughput(session, [f"{rurl}/generate"], b, ns.concurrency,
                                                                ns.duration, stream, watched, bar)
                    if router.poll() is not None:
                        raise BenchError(f"{name} exited with {router.returncode}:\n{procs.log_tail(name)}")
                    res["router_metrics"] = await router_counts(session, rurl)
                    report["policies"][policy] = res
                finally:
                    procs.stop(router)
    finally:
        os.sched_setaffinity(0, own)
    return report


def _bar(ns: argparse.Namespace, total: float, desc: str, unit: str) -> tqdm[Any]:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, disable=ns.disable_tqdm, file=sys.stderr, leave=False)


def print_stub_report(rep: dict[str, Any]) -> None:
    w = 46
    print(f"{' Router Benchmark (stub workers) ':=^{w + 16}}")
    pinned = rep["pinned"]
    print(f"{'Router CPUs / stubs + client CPUs':<{w}}"
          f"{(str(pinned['router']) + ' / ' + str(pinned['stubs_and_client'])) if pinned else 'not pinned':>16}")
    d = rep["direct_throughput"]
    print(f"{'Direct to stubs (req/s)':<{w}}{_f(d['requests_per_s'], 1):>16}")
    util = f"{d['stubs_cpu_util']:.2f} / {d['client_cpu_util']:.2f}"
    print(f"{'Direct: CPU utilisation stubs / client':<{w}}{util:>16}")
    for policy, res in rep["policies"].items():
        lat, thr, st = res["latency"], res["throughput"], res["streaming"]
        print(f"{' ' + policy + ' ':-^{w + 16}}")
        rows: list[tuple[str, Any, int]] = [
            ("Latency direct P50 / P99 (ms)", f"{_f(lat['direct']['p50_ms'])} / {_f(lat['direct']['p99_ms'])}", 0),
            ("Latency routed P50 / P99 (ms)", f"{_f(lat['routed']['p50_ms'])} / {_f(lat['routed']['p99_ms'])}", 0),
            ("Added by the router P50 / P99 (ms)", f"{_f(lat['added_p50_ms'])} / {_f(lat['added_p99_ms'])}", 0),
            ("Throughput (req/s)", thr["requests_per_s"], 1),
            ("CPU utilisation router / stubs / client",
             f"{thr['router_cpu_util']:.2f} / {thr['stubs_cpu_util']:.2f} / {thr['client_cpu_util']:.2f}", 0),
            ("Router CPU ms / request", thr["router_cpu_ms_per_request"], 3),
            ("Requests per router-CPU-second", thr["requests_per_router_cpu_s"], 0),
            ("Streaming throughput (req/s)", st["requests_per_s"], 1),
            ("Streaming: requests per router-CPU-second", st["requests_per_router_cpu_s"], 0),
        ]
        for name, val, digits in rows:
            print(f"{name:<{w}}{_f(val, digits):>16}")
        errs = {**lat["errors"], **thr["errors"], **{f"stream: {k}": v for k, v in st["errors"].items()}}
        if errs:
            print(f"{'Errors':<{w}}{json.dumps(errs)}")
    print("=" * (w + 16))
