"""What both modes of ``radixserve bench router`` share (``router_bench`` with stub workers,
``router_bench_real`` with real ones): the policy list, argument splitting, the machine record,
number formatting and the router's request counts from its ``/metrics``."""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import re
import shlex
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from radixserve.bench.subprocs import BenchError

if TYPE_CHECKING:
    import aiohttp


POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")


BENCH_SERVE_DEFAULTS = ("--num-prompts", "16", "--num-turns", "4", "--input-len", "256", "--turn-len", "64",
                        "--output-len", "16")


def _split_args(items: Sequence[str]) -> list[str]:
    return [a for item in items for a in shlex.split(item)]


def _policies(ns: argparse.Namespace) -> list[str]:
    """The policies to run: ``--policy``, or ``--compare-policies`` items, each a policy name, or with
    real workers ``NAME+events`` (the router follows the workers' cache events)."""
    if not ns.compare_policies:
        return [ns.policy]
    names = [x.strip() for x in ns.compare_policies.split(",") if x.strip()]
    real = getattr(ns, "real_workers", 0) > 0
    bad = [x for x in names if x.removesuffix("+events" if real else "") not in POLICIES]
    if bad or not names:
        raise BenchError(f"--compare-policies: unknown {', '.join(bad) or '(none)'}; choose from {', '.join(POLICIES)}"
                         + (" (with --real-workers, NAME+events too)" if real else ""))
    return names


def _machine() -> dict[str, Any]:
    import aiohttp

    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    return {"cpu_model": model, "cpus": os.cpu_count(), "affinity": sorted(os.sched_getaffinity(0)),
            "python": platform.python_version(), "aiohttp": aiohttp.__version__}


def _f(x: Any, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:,.{digits}f}"
    return f"{x:,}" if isinstance(x, int) else str(x)


_REQ_LINE = re.compile(r'^radixserve_router_requests_total\{([^}]*)\}\s+([0-9.e+]+)$')


_DECISION_LINE = re.compile(r'^radixserve_router_decisions_total\{([^}]*)\}\s+([0-9.e+]+)$')


def _labels(s: str) -> dict[str, str]:
    return dict(re.findall(r'(\w+)="([^"]*)"', s))


async def router_counts(session: aiohttp.ClientSession, url: str) -> dict[str, dict[str, int]]:
    """Requests per worker and decisions per branch, from the router's /metrics."""
    import aiohttp

    per_worker: Counter[str] = Counter()
    branches: Counter[str] = Counter()
    try:
        async with session.get(f"{url}/metrics") as r:
            text = await r.text()
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return {}
    for line in text.splitlines():
        if m := _REQ_LINE.match(line):
            per_worker[_labels(m.group(1)).get("worker", "?")] += int(float(m.group(2)))
        elif m := _DECISION_LINE.match(line):
            branches[_labels(m.group(1)).get("branch", "?")] += int(float(m.group(2)))
    return {"requests_per_worker": dict(per_worker), "decisions": dict(branches)}
