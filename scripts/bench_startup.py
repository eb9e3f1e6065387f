"""Time to a healthy server, alternated: ``radixserve serve``, ``radixserve launch --num-workers N``
(the router healthy with every worker), and optionally llama.cpp's ``llama-server`` on the same
file; medians and each one's ratio to ``serve``.

    python scripts/bench_startup.py --rounds 8 [--num-workers 2] [--model-path F]
        [--llama-server PATH] [--output startup.json]

Each start is timed from the command's launch to the first 200 from ``/health`` (polled every
50 ms with one HTTP client), then the whole process group is stopped and the next command starts
after a pause. This measures a warm start (files in the page cache, the C++ extensions built):
on a fresh machine, run any server once first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from radixserve.bench.subprocs import free_ports, stop_group
from radixserve.results import write_result
from radixserve.router.launch import StartFailed, wait_healthy


def start_once(cmd: list[str], url: str) -> float:
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        wait_healthy({url: proc}, 600)
        return time.perf_counter() - t0
    finally:
        stop_group(proc, 30)


def commands(a: argparse.Namespace, port: int) -> dict[str, list[str]]:
    model = ["--model-path", a.model_path] if a.model_path else []
    cli = [sys.executable, "-m", "radixserve.cli"]
    out = {
        "serve": [*cli, "serve", "--port", str(port), *model],
        f"launch-{a.num_workers}": [*cli, "launch", "--num-workers", str(a.num_workers), "--port", str(port), *model],
    }
    if a.llama_server:
        if not a.model_path:
            from radixserve.model.loader import resolve_model_path

            a.model_path = resolve_model_path(None)[1]
        out["llama-server"] = [a.llama_server, "-m", a.model_path, "--host", "127.0.0.1", "--port", str(port),
                               "-np", "1", "-t", str(os.cpu_count() or 1)]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=6, help="Starts of each command, alternated (default: 6).")
    p.add_argument("--num-workers", type=int, default=2, help="Workers of the launch command (default: 2).")
    p.add_argument("--model-path", default=None, help="Model file (default: the bundled SmolLM2).")
    p.add_argument("--llama-server", default=None, help="llama-server binary to time on the same file too.")
    p.add_argument("--pause", type=float, default=1.5, help="Seconds between starts (default: 1.5).")
    p.add_argument("--output", default=None, help="Write the figures as JSON here.")
    a = p.parse_args()
    times: dict[str, list[float]] = {}
    for r in range(a.rounds):
        port = free_ports(a.num_workers + 1, consecutive=True)[0]
        for name, cmd in commands(a, port).items():
            try:
                dt = start_once(cmd, f"http://127.0.0.1:{port}")
            except StartFailed as e:
                print(f"round {r + 1}: {name}: {e}", file=sys.stderr)
                return 1
            times.setdefault(name, []).append(dt)
            print(f"round {r + 1}: {name:14s} healthy after {dt:.2f} s", flush=True)
            time.sleep(a.pause)
    base = statistics.median(times["serve"])
    summary = {}
    print(f"\n{'command':14s} {'median':>7s} {'min':>6s} {'max':>6s}  to serve")
    for name, v in times.items():
        med = statistics.median(v)
        summary[name] = {"median_s": med, "min_s": min(v), "max_s": max(v), "ratio_to_serve": med / base,
                         "runs_s": v}
        print(f"{name:14s} {med:7.2f} {min(v):6.2f} {max(v):6.2f}  {med / base:.2f}x")
    if a.output:
        write_result(a.output, {"rounds": a.rounds, "num_workers": a.num_workers, "results": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
