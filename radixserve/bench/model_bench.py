"""``radixserve bench model``: one model file served by ``radixserve serve`` and by llama.cpp's
``llama-server``, side by side.

For each round, each server in turn: start it alone on a free port (the other is stopped, so the
two never share the CPUs) with the same KV capacity (``--concurrency`` slots of the prompt and
output length), time how long until ``/health`` answers 200, read its resident memory,
then run the single-stream workload (``--input-len`` random tokens in, ``--output-len`` out, one
request at a time) and the concurrent one (``--concurrency`` requests in flight), and stop it.
Rounds alternate the order, so drift on a shared machine hits both alike. Prints per server the
medians over rounds (TPOT, TTFT, output tokens/s, time to healthy, RSS) and radixserve's ratio to
llama-server on each.

    radixserve bench model --model-path model.Q4_K_M.gguf --llama-server ~/.cache/llama.cpp-server/build/bin/llama-server
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from radixserve.bench.serving import ServingBenchmark
from radixserve.bench.serving import add_args as add_serving_args
from radixserve.bench.subprocs import BenchError, free_ports
from radixserve.results import write_result
from radixserve.router.launch import StartFailed, wait_healthy

STARTUP_TIMEOUT_S = 600.0


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-path", default=None, help="The GGUF file both servers load (default: the bundled SmolLM2).")
    p.add_argument("--llama-server", default=None,
                   help="llama-server binary (bash ../shared/tools/build_llama_server.sh prints its path); without "
                        "it only radixserve is measured.")
    p.add_argument("--server-args", default="", help="More 'radixserve serve' options, as one string "
                   "(--server-args='--max-total-tokens 8192').")
    p.add_argument("--llama-args", default="", help="More llama-server options, as one string.")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="Threads of both servers.")
    p.add_argument("--input-len", type=int, default=256, help="Prompt tokens (random ids).")
    p.add_argument("--output-len", type=int, default=128, help="Tokens generated per request.")
    p.add_argument("--single-prompts", type=int, default=4, help="Requests of the single-stream run.")
    p.add_argument("--concurrency", type=int, default=32, help="Requests in flight in the concurrent run (0: skip).")
    p.add_argument("--concurrent-prompts", type=int, default=64, help="Requests of the concurrent run.")
    p.add_argument("--rounds", type=int, default=2, help="Rounds, the servers' order alternating.")
    p.add_argument("--output", default=None, help="Write the figures as JSON here.")


class Server:
    """One server process started for a round, its output in a temporary log."""

    def __init__(self, name: str, cmd: list[str], port: int) -> None:
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        fd, self.log = tempfile.mkstemp(prefix=f"radixserve-bench-model-{name}-", suffix=".log")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=fd, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        os.close(fd)
        self.healthy_s = self._wait_healthy(t0)

    def _wait_healthy(self, t0: float) -> float:
        try:
            wait_healthy({self.url: self.proc}, STARTUP_TIMEOUT_S)
        except StartFailed as e:
            self.stop()
            raise BenchError(f"{self.name}: {e}:\n{self.tail()}") from None
        return time.perf_counter() - t0

    def tail(self, n: int = 2000) -> str:
        with open(self.log, "rb") as f:
            return f.read()[-n:].decode(errors="replace")

    def rss_mb(self) -> float:
        """Resident memory of the server's process group (radixserve: HTTP, scheduler, detokenizer)."""
        total = 0
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                if os.getpgid(int(pid)) != self.proc.pid:
                    continue
                with open(f"/proc/{pid}/status") as f:
                    total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
            except (OSError, StopIteration, ProcessLookupError):
                continue
        return total / 1024

    def stop(self) -> None:
        import signal

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def _commands(ns: argparse.Namespace, model: str, port: int) -> dict[str, list[str]]:
    # the same KV capacity on both sides (llama-server's -c is shared by its slots), so that their
    # resident memory compares like for like
    ctx = ns.input_len + ns.output_len + 16
    slots = max(1, ns.concurrency)
    cmds = {"radixserve": [sys.executable, "-m", "radixserve.cli", "serve", "--model-path", model, "--host",
                           "127.0.0.1", "--port", str(port), "--num-threads", str(ns.threads), "--max-total-tokens",
                           str(slots * ctx), *shlex.split(ns.server_args)]}
    if ns.llama_server:
        cmds["llama-server"] = [ns.llama_server, "-m", model, "--host", "127.0.0.1", "--port", str(port),
                                "-np", str(slots), "-c", str(slots * ctx), "-t", str(ns.threads), "-tb",
                                str(ns.threads), "--alias", "default", *shlex.split(ns.llama_args)]
    return cmds


def _workload(ns: argparse.Namespace, url: str, prompts: int, concurrency: int) -> dict[str, Any]:
    p = argparse.ArgumentParser()
    add_serving_args(p)  # bench serve's own defaults for every option not given here
    args = p.parse_args(["--base-url", url, "--workload", "random", "--num-prompts", str(prompts),
                         "--input-len", str(ns.input_len), "--output-len", str(ns.output_len),
                         "--max-concurrency", str(concurrency), "--disable-tqdm"])
    rep = asyncio.run(ServingBenchmark(args).run())
    if rep["failed"]:
        raise BenchError(f"{rep['failed']} requests failed against {url}: {rep['errors']}")
    return rep


def _figures(server: Server, single: dict[str, Any], many: dict[str, Any] | None, rss: float) -> dict[str, float]:
    out = {"healthy_s": server.healthy_s, "rss_mb": rss, "tpot_p50_ms": single["tpot"]["p50_ms"],
           "ttft_p50_ms": single["ttft"]["p50_ms"], "single_output_tok_s": single["output_throughput"]}
    if many is not None:
        out["concurrent_output_tok_s"] = many["output_throughput"]
        out["concurrent_tpot_p50_ms"] = many["tpot"]["p50_ms"]
    return out


def main(ns: argparse.Namespace) -> int:
    try:
        return _run(ns)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def _inputs(ns: argparse.Namespace) -> str:
    """The model file, after checking it and the llama-server binary exist (BenchError if not)."""
    from radixserve.model.loader import resolve_model_path

    try:
        model = resolve_model_path(ns.model_path)[1]
    except (FileNotFoundError, ValueError) as e:
        raise BenchError(str(e)) from None
    if ns.llama_server and not (os.path.isfile(ns.llama_server) and os.access(ns.llama_server, os.X_OK)):
        raise BenchError(f"--llama-server {ns.llama_server} is not an executable file")
    return model


def _run(ns: argparse.Namespace) -> int:
    model = _inputs(ns)
    runs: dict[str, list[dict[str, float]]] = {}
    names = list(_commands(ns, model, 0))
    for r in range(ns.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            port = free_ports(1)[0]
            print(f"round {r + 1}/{ns.rounds}: {name}: starting", flush=True)
            server = Server(name, _commands(ns, model, port)[name], port)
            try:
                single = _workload(ns, server.url, ns.single_prompts, 1)
                many = _workload(ns, server.url, ns.concurrent_prompts, ns.concurrency) if ns.concurrency else None
                rss = server.rss_mb()
            finally:
                server.stop()
            figs = _figures(server, single, many, rss)
            runs.setdefault(name, []).append(figs)
            print(f"  {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in figs.items()), flush=True)
    medians = {name: {k: statistics.median(f[k] for f in fs) for k in fs[0]} for name, fs in runs.items()}
    print(f"\nmedians over {ns.rounds} rounds, {os.path.basename(model)}, {ns.threads} threads, "
          f"{ns.input_len} in / {ns.output_len} out, concurrency {ns.concurrency}:")
    keys = list(medians["radixserve"])
    print(f"{'':<26}" + "".join(f"{n:>16}" for n in medians) + ("   radixserve / llama" if len(medians) > 1 else ""))
    for k in keys:
        row = f"{k:<26}" + "".join(f"{m[k]:>16.1f}" for m in medians.values())
        if "llama-server" in medians and medians["llama-server"][k]:
            row += f"   {medians['radixserve'][k] / medians['llama-server'][k]:>8.2f}x"
        print(row)
    if ns.output:
        write_result(ns.output, {"model": model, "threads": ns.threads, "input_len": ns.input_len,
                                 "output_len": ns.output_len, "concurrency": ns.concurrency, "rounds": runs,
                                 "medians": medians})
    return 0
