"""Benchmark results as data: every ``radixserve bench ... --output FILE`` (and ``radixserve simulate
--output FILE``) writes its figures as JSON
with the date, the command and the machine it ran on, so a figure can be compared only with figures
from the same kind of machine. ``scripts/run_benchmarks.sh`` collects one run's files under
``bench/results/<date>-<machine>/``; docs/benchmarks.md keeps the one current summary table."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from importlib import metadata
from typing import Any

# CPU features that change what a figure means here (bf16 GEMMs, VNNI block kernels, AMX tiles)
_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")


def machine() -> dict[str, Any]:
    """What the figures depend on: the CPU model and its relevant features, cores, memory, and the
    versions of Python and torch."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and ":" in line:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and ":" in line:
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    try:
        mem_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        mem_gib = None
    try:
        torch_version: str | None = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = None
    return {"cpu": model, "cpu_features": [f for f in _FLAGS if f in flags], "cores": os.cpu_count(),
            "memory_gib": mem_gib, "python": platform.python_version(), "torch": torch_version}


def machine_tag() -> str:
    """A short name for this kind of machine, for a results folder: ``amd-epyc-avx512_bf16-2c``."""
    m = machine()
    words = "".join(c if c.isalnum() else " " for c in str(m["cpu"]).lower()).split()[:2]
    best = next((f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f in m["cpu_features"]), "base")
    return "-".join([*words, best, f"{m['cores']}c"])


def _commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=os.path.dirname(os.path.abspath(__file__)))
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def write_result(path: str, figures: dict[str, Any]) -> None:
    """Write ``figures`` to ``path`` as JSON, with when, what and where it was measured."""
    doc = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": ["radixserve", *sys.argv[1:]] if sys.argv[0].endswith("radixserve") else sys.argv,
           "commit": _commit(), "machine": machine(), **figures}
    with open(path, "w") as f:
        json.dump(doc, f, indent=2, default=str)
