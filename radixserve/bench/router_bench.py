"""``radixserve bench router``: what the router itself costs, and what its policy buys on real workers.

    radixserve bench router [--policy cache_aware] [--compare-policies cache_aware,round_robin]
                            [--num-stub-workers 2] [--requests 1000] [--duration 5] [--concurrency 64]
                            [--router-arg=--max-concurrent-requests=512] [--output results.json]

Against stub workers (``radixserve.bench.stub_worker``: they answer at once, with no model), all
started here as subprocesses with one ``radixserve router`` per policy in front of them:

1. latency: non-streaming ``/generate`` calls one at a time, straight to a stub and through the
   router, from the same client on the same keep-alive connections, in alternating blocks (the
   order flips every round) so that a drift of the shared host hits both sides alike; P50 / P99 of
   each side and the difference (what a request pays for the extra hop);
2. throughput: the router pinned to one core, the stubs and this process (the load generator) on
   the others; ``--concurrency`` requests kept in flight for ``--duration`` seconds, non-streaming
   then streaming (SSE relayed chunk by chunk). Reported: requests/s, and the router's CPU seconds
   per request from ``/proc/<pid>/stat``, as "requests per router-CPU-second": on a 2-core machine
   the client and the stubs share one core and may be what limits requests/s, while the router's
   CPU per request does not depend on who is the bottleneck. The same load sent straight to the
   stubs is measured once, as the ceiling of the client and stubs.

The prompts are text (``--prompt-chars``), most of each one a shared prefix (``--num-prefixes``
of them), so the cache_aware policy's tree matches and grows as it would in service.

With ``--real-workers N``: ``radixserve launch`` starts N real workers and the router, once per
policy (fresh workers each time, so no run inherits a warm cache), and ``radixserve bench serve``
(default: the multi-turn workload) runs against the router; reported per policy: the prefix-cache
hit rate (cached / prompt tokens, from the workers' ``usage.prompt_tokens_details``), TTFT and
where the router sent the requests.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Callable
from typing import Any

from radixserve.bench.router_bench_common import BENCH_SERVE_DEFAULTS, POLICIES, _policies
from radixserve.bench.router_bench_real import print_real_report, run_real
from radixserve.bench.router_bench_stubs import print_stub_report, run_stubs
from radixserve.bench.subprocs import BenchError, Procs
from radixserve.results import write_result

# NOTE: aiohttp, tqdm and bench.serving are imported where they are used (here and in the modes'
# modules): the CLI imports this module to build its parser, and every radixserve command would pay
# for them otherwise.


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", choices=POLICIES, default="cache_aware", help="Router policy.")
    p.add_argument("--compare-policies", default=None,
                   help="Comma-separated policies to run one after another (e.g. cache_aware,round_robin); "
                        "overrides --policy. With --real-workers, NAME+events runs NAME with the workers "
                        "publishing cache events and the router following them (--prefix-match tokens).")
    p.add_argument("--num-stub-workers", type=int, default=2, help="Stub workers behind the router.")
    p.add_argument("--requests", type=int, default=1000, help="Latency samples per side (direct, routed).")
    p.add_argument("--block", type=int, default=20, help="Latency: requests per block before switching side.")
    p.add_argument("--duration", type=float, default=5.0, help="Seconds of each throughput phase.")
    p.add_argument("--concurrency", type=int, default=64, help="Requests in flight in the throughput phases.")
    p.add_argument("--prompt-chars", type=int, default=512, help="Characters of each prompt.")
    p.add_argument("--users", type=int, default=0,
                   help="Stubs: each request names one of this many users (the OpenAI user field: a routing key "
                        "with --router-arg=--routing-key-user, a tenant for rate limits); 0: none.")
    p.add_argument("--num-prefixes", type=int, default=8,
                   help="Distinct shared prefixes (3/4 of each prompt); the rest is random.")
    p.add_argument("--stream-chunks", type=int, default=4, help="SSE events of each streamed stub answer.")
    p.add_argument("--no-pin", action="store_true", help="Do not pin the router to a core of its own.")
    p.add_argument("--router-arg", action="append", default=[], metavar="ARGS",
                   help="Extra router options, passed through; repeatable. Write it as "
                        "--router-arg=--cache-threshold=0.5 or --router-arg '--cache-threshold 0.5'.")
    p.add_argument("--real-workers", type=int, default=0, metavar="N",
                   help="Instead of stubs: start N real workers with 'radixserve launch' per policy and run "
                        "'radixserve bench serve' against the router.")
    p.add_argument("--workload", default="multi-turn", choices=("random", "shared-prefix", "multi-turn"),
                   help="--real-workers: the bench serve workload.")
    p.add_argument("--bench-serve-arg", action="append", default=[], metavar="ARGS",
                   help="--real-workers: extra 'bench serve' options (default: "
                        f"{' '.join(BENCH_SERVE_DEFAULTS)}); repeatable, as --router-arg.")
    p.add_argument("--launch-arg", action="append", default=[], metavar="ARGS",
                   help="--real-workers: extra engine options for the workers ('radixserve launch'); repeatable.")
    p.add_argument("--max-total-tokens", type=int, default=16384, help="--real-workers: each worker's KV pool.")
    p.add_argument("--rounds", type=int, default=1,
                   help="--real-workers: run the policies this many times, alternating (A B A B).")
    p.add_argument("--startup-timeout", type=float, default=900.0,
                   help="--real-workers: seconds to wait for the fleet to come up.")
    p.add_argument("--port", type=int, default=0, help="Router port (default: a free one).")
    p.add_argument("--output", default=None, help="Write the results as JSON here.")
    p.add_argument("--disable-tqdm", action="store_true", help="No progress bars.")


def _check(ns: argparse.Namespace) -> None:
    bad = [f"--{k.replace('_', '-')}" for k in ("num_stub_workers", "requests", "block", "concurrency",
                                                  "prompt_chars", "rounds") if getattr(ns, k) < 1]
    if not ns.duration > 0:
        bad.append("--duration")
    if bad:
        raise BenchError(f"{', '.join(bad)} must be positive")
    _policies(ns)


def main(ns: argparse.Namespace) -> int:
    procs = Procs()
    run: Callable[[argparse.Namespace, Procs], Any] = run_real if ns.real_workers > 0 else run_stubs
    # SIGTERM as Ctrl-C, so that the subprocesses are stopped on the way out either way
    old = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        _check(ns)
        rep = asyncio.run(run(ns, procs))
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        procs.stop_all()
        signal.signal(signal.SIGTERM, old)
    if rep["mode"] == "stubs":
        print_stub_report(rep)
    else:
        print_real_report(rep)
    if ns.output:
        write_result(ns.output, rep)
    return 0
