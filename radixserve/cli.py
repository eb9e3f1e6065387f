"""``radixserve`` command line: generate, serve, bench, simulate, route."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from radixserve.config import ServerArgs


def _generate(ns: argparse.Namespace) -> int:
    from radixserve.engine import Engine

    args = ServerArgs.from_cli_args(ns)
    kwargs = {k: v for k, v in vars(args).items() if k != "model_path"}
    try:
        engine = Engine(args.model_path, **kwargs)
    except (OSError, ValueError, NotImplementedError, RuntimeError) as e:  # the model cannot be loaded: say why
        print(f"error: cannot load the model: {e}", file=sys.stderr)
        return 1
    prompt = ns.prompt
    if ns.chat:
        prompt = engine.apply_chat_template([{"role": "user", "content": prompt}])
    params = {"max_new_tokens": ns.max_new_tokens, "temperature": ns.temperature, "top_p": ns.top_p,
              "top_k": ns.top_k}
    if ns.seed is not None:
        params["seed"] = ns.seed
    if ns.stream:
        for chunk in engine.generate_stream(prompt, params):
            sys.stdout.write(chunk["text"])
            sys.stdout.flush()
            if chunk["finished"]:
                meta = chunk["meta_info"]
        sys.stdout.write("\n")
    else:
        out = engine.generate(prompt, params)
        assert isinstance(out, dict)
        print(out["text"])
        meta = out["meta_info"]
    if ns.verbose:
        print(json.dumps(meta, indent=2), file=sys.stderr)
    fr = meta.get("finish_reason") or {}
    if fr.get("type") == "abort":
        print(f"error: {fr.get('message')}", file=sys.stderr)
        return 1
    return 0


def _serve(ns: argparse.Namespace) -> int:
    from radixserve.server.launch import launch_server

    return launch_server(ServerArgs.from_cli_args(ns))


def _bench_serve(ns: argparse.Namespace) -> int:
    from radixserve.bench.serving import main

    return main(ns)


def _bench_model(ns: argparse.Namespace) -> int:
    from radixserve.bench.model_bench import main

    return main(ns)


def _bench_router(ns: argparse.Namespace) -> int:
    from radixserve.bench.router_bench import main

    return main(ns)


def _bench_chunking(ns: argparse.Namespace) -> int:
    from radixserve.bench.chunking import main

    return main(ns)


def _bench_offline(ns: argparse.Namespace) -> int:
    from radixserve.bench.offline import main

    return main(ns)


def _bench_attention(ns: argparse.Namespace) -> int:
    from radixserve.bench.attention import main

    return main(ns)


def _bench_radix(ns: argparse.Namespace) -> int:
    from radixserve.bench.radix import main

    return main(ns)


def _bench_fuzz(ns: argparse.Namespace) -> int:
    from radixserve.bench.fuzz import main

    return main(ns)


def _bench_soak(ns: argparse.Namespace) -> int:
    from radixserve.bench.soak import main

    return main(ns)


def _router(ns: argparse.Namespace) -> int:
    from radixserve.router.app import run_router
    from radixserve.router.config import RouterArgs
    from radixserve.router.discovery import provider

    try:
        args = RouterArgs.from_cli_args(ns)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not args.worker_urls and not args.pd_disaggregation and provider(args) is None:
        print("error: give at least one worker with --worker-urls URL [URL ...] (or --pd-disaggregation with "
              "--prefill and --decode workers, or a --discovery-file or --discovery-provider)", file=sys.stderr)
        return 2
    return run_router(args)


def _launch(ns: argparse.Namespace) -> int:
    from radixserve.router.launch import launch_fleet

    return launch_fleet(ns)


def _simulate(ns: argparse.Namespace) -> int:
    from radixserve.sim.cli import main

    return main(ns)


COMMANDS = ("generate", "serve", "bench", "router", "launch", "simulate")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line, or (``command``) only that command's part: the benchmarks' and the
    router's options import their modules (~0.3 s), which a server starting up need not wait for."""
    p = argparse.ArgumentParser(prog="radixserve", description="An SGLang-shaped LLM serving engine.")
    sub = p.add_subparsers(dest="command", required=True)
    if command in (None, "generate"):
        _generate_parser(sub)
    if command in (None, "serve"):
        s = sub.add_parser("serve", help="Serve a model over HTTP (OpenAI-compatible and SGLang-native APIs).")
        ServerArgs.add_cli_args(s)
        s.set_defaults(func=_serve)
    if command in (None, "bench"):
        bench = sub.add_parser("bench", help="Benchmarks.")
        _bench_parsers(bench.add_subparsers(dest="bench_command", required=True))
    if command in (None, "router", "launch"):
        _fleet_parsers(sub)
    if command in (None, "simulate"):
        _simulate_parser(sub)
    return p


def _generate_parser(sub: Any) -> None:
    g = sub.add_parser("generate", help="Generate text for one prompt in-process.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g.add_argument("prompt", help="The prompt text.")
    g.add_argument("--chat", action="store_true", help="Wrap the prompt in the model's chat template.")
    g.add_argument("--max-new-tokens", type=int, default=128, help="Most tokens to generate.")
    g.add_argument("--temperature", type=float, default=0.0, help="Sampling temperature; 0 is greedy.")
    g.add_argument("--top-p", type=float, default=1.0, help="Nucleus sampling mass.")
    g.add_argument("--top-k", type=int, default=-1, help="Sample among the k likeliest tokens; -1 disables.")
    g.add_argument("--seed", type=int, default=None, help="Per-request sampling seed.")
    g.add_argument("--stream", action="store_true", help="Print tokens as they are generated.")
    g.add_argument("-v", "--verbose", action="store_true", help="Print meta_info (token counts, finish reason).")
    ServerArgs.add_cli_args(g)
    g.set_defaults(func=_generate)


def _bench_parsers(bsub: Any) -> None:
    _bench_offline_parser(bsub)
    _bench_chunking_parser(bsub)
    bs = bsub.add_parser("serve", help="Load-test any OpenAI-compatible server (TTFT, TPOT, ITL, throughput).",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    from radixserve.bench.serving import add_args as _bench_serve_args

    _bench_serve_args(bs)
    bs.set_defaults(func=_bench_serve)
    bm = bsub.add_parser("model", help="One GGUF file served by radixserve and by llama.cpp's llama-server in turn: "
                         "single-stream TPOT, concurrent output tokens/s, time to healthy, RSS, and the ratios.",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    from radixserve.bench.model_bench import add_args as _bench_model_args

    _bench_model_args(bm)
    bm.set_defaults(func=_bench_model)
    br = bsub.add_parser("router", help="What the router costs (added latency, requests per router-CPU-second) "
                         "against stub workers; with --real-workers, cache hit rate and TTFT per policy.",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    from radixserve.bench.router_bench import add_args as _bench_router_args

    _bench_router_args(br)
    br.set_defaults(func=_bench_router)
    ba = bsub.add_parser("attention", help="One layer of decode attention per backend (torch_native vs cpu_paged) "
                         "at several batch sizes and contexts, with the kernel's effective memory bandwidth.",
                         description="Times one layer of decode attention of the model's shape per backend, "
                         "alternating the backends, and prints the last backend's effective bandwidth (the K/V "
                         "and slot-table bytes it must read over its time) next to a STREAM-style copy measured "
                         "in the same run.", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    from radixserve.bench.attention_args import add_args as _bench_attention_args

    _bench_attention_args(ba)
    ba.set_defaults(func=_bench_attention)
    brx = bsub.add_parser("radix", help="The prefix cache alone: insert, match and evict over a 1M-token chat "
                          "trace, with the real slot allocator and with a counting stand-in.",
                          description="Builds a RadixCache from a chat-like trace (shared system prompts, "
                          "conversations, private tails) until it holds the pool, matches every request, evicts "
                          "half; each phase timed with the real allocator and with one that only counts, "
                          "alternated.", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    from radixserve.bench.radix_args import add_args as _bench_radix_args

    _bench_radix_args(brx)
    brx.set_defaults(func=_bench_radix)

    bf = bsub.add_parser("fuzz", help="Fuzz a server: schemathesis over /openapi.json and a mutation fuzzer of "
                         "valid bodies; zero 5xx and a healthy server after (docs/reliability.md).",
                         description="Starts a server with a small context (or targets --base-url), runs at least "
                         "--cases schemathesis cases over every documented route (positive and negative) and "
                         "--mutations mutated valid bodies, one at a time, then prints the status-code histogram, "
                         "every 5xx with a curl line to reproduce it, and whether the server is healthy after "
                         "(/health, a real generation, the KV pool and request slots all free once idle). Exits 1 "
                         "on any 5xx, unanswered request or unhealthy server.",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    from radixserve.bench.fuzz import add_args as _bench_fuzz_args

    _bench_fuzz_args(bf)
    bf.set_defaults(func=_bench_fuzz)
    bk = bsub.add_parser("soak", help="Soak a server: many requests of mixed lengths with aborts, disconnects and "
                         "invalid ones; zero leaked KV or request slots, bounded memory (docs/reliability.md).",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    from radixserve.bench.soak import DESCRIPTION as _SOAK_DESCRIPTION
    from radixserve.bench.soak import add_args as _bench_soak_args

    bk.description = _SOAK_DESCRIPTION
    _bench_soak_args(bk)
    bk.set_defaults(func=_bench_soak)


def _bench_offline_parser(bsub: Any) -> None:
    bo = bsub.add_parser("offline", help="Throughput of the in-process engine on a fixed workload.",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    bo.add_argument("--workload", choices=["random", "shared-prefix", "multi-turn"], default="random",
                    help="random: 128 prompts, 256 in / 128 out; shared-prefix: 8 groups x 16 prompts, "
                         "512-token system prompt + 64-token question, 128 out; multi-turn: 16 conversations x 4 turns.")
    bo.add_argument("--num-prompts", type=int, default=None,
                    help="Override the workload's prompt count (per group for shared-prefix).")
    bo.add_argument("--input-len", type=int, default=None, help="random workload: prompt tokens (default 256).")
    bo.add_argument("--output-len", type=int, default=None, help="random workload: output tokens (default 128).")
    bo.add_argument("--seed", type=int, default=0, help="Workload seed.")
    bo.add_argument("--model-path", default=None, help="Model (default: the bundled SmolLM2).")
    bo.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="Model dtype.")
    bo.add_argument("--schedule-policy", default="fcfs", help="Waiting-queue policy.")
    bo.add_argument("--attention-backend", default="auto", choices=["auto", "torch_native", "cpu_paged"],
                    help="Attention implementation (see radixserve serve --help).")
    bo.add_argument("--quantization", default="auto", choices=["auto", "none", "gguf", "int8", "int4"],
                    help="How the linear weights are held: a GGUF's own blocks, float, or int8/int4 copies "
                         "(see radixserve serve --help; docs/model.md).")
    bo.add_argument("--scheduler", default="sglang", choices=["sglang", "unified"], help="Scheduler.")
    bo.add_argument("--max-total-tokens", type=int, default=None, help="KV pool size in tokens.")
    bo.add_argument("--disable-hybrid-swa-memory", action="store_true",
                    help="Sliding-window layers keep every position's K/V as the global ones do (see radixserve "
                         "serve --help); the KV memory the run touched is printed either way.")
    bo.add_argument("--max-running-requests", type=int, default=None,
                    help="Most requests decoding at once (default: the engine's own limit).")
    bo.add_argument("--compare-hf", action="store_true",
                    help="Also run HF transformers generate (static batches) on the same prompts and print the ratio.")
    bo.add_argument("--hf-batch-size", type=int, default=32, help="HF static batch size.")
    bo.add_argument("--decode-batch", type=int, default=0,
                    help="Also time the decode step at this batch size next to the model's matmuls alone.")
    bo.add_argument("--compare-loops", type=int, default=0, metavar="ROUNDS",
                    help="With --decode-batch: time the whole decode step under the overlap loop and the normal "
                         "loop, alternated this many rounds each, and print the ratio.")
    bo.add_argument("--compare-attention", type=int, default=0, metavar="ROUNDS",
                    help="With --decode-batch: time the whole decode step with the torch_native and the cpu_paged "
                         "attention backends, swapped into the one loaded model and alternated this many rounds "
                         "each, and print the ratio.")
    bo.add_argument("--compare-small-ops", type=int, default=0, metavar="ROUNDS",
                    help="With --decode-batch: time the whole decode step with the torch small ops (the reference) "
                    "and the fused C++ ones, swapped into the one loaded model, alternated ROUNDS times.")
    bo.add_argument("--overlap-schedule", choices=("auto", "on", "off"), default="auto",
                    help="The engine's event loop: on (overlap), off (normal) or auto (normal on this CPU engine; "
                         "see radixserve serve --help).")
    bo.add_argument("--output", default=None, help="Write the results as JSON here.")
    bo.set_defaults(func=_bench_offline)


def _bench_chunking_parser(bsub: Any) -> None:
    bc = bsub.add_parser("chunking", help="TPOT of decoding requests while long prompts are prefilled "
                         "(chunked, --enable-mixed-chunk, --enable-dynamic-chunking).",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    bc.add_argument("--model-path", default=None, help="Model (default: the bundled SmolLM2).")
    bc.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="Model dtype.")
    bc.add_argument("--num-short", type=int, default=8, help="Requests decoding when the long prompts arrive.")
    bc.add_argument("--num-long", type=int, default=2, help="Long prompts arriving.")
    bc.add_argument("--long-len", type=int, default=2048, help="Tokens of each long prompt.")
    bc.add_argument("--chunked-prefill-size", type=int, default=512, help="The engine's chunk size.")
    bc.add_argument("--dynamic-chunk-target-ms", type=float, default=150.0,
                    help="The step-time target of --enable-dynamic-chunking.")
    bc.add_argument("--configs", default="chunked,mixed,dynamic,mixed+dynamic",
                    help="Comma-separated configurations: chunked (plain chunked prefill), mixed "
                         "(--enable-mixed-chunk), dynamic (--enable-dynamic-chunking), mixed+dynamic.")
    bc.add_argument("--rounds", type=int, default=2, help="Alternated rounds per configuration.")
    bc.set_defaults(func=_bench_chunking)


def _fleet_parsers(sub: Any) -> None:
    from radixserve.router.config import RouterArgs
    from radixserve.router.launch import add_launch_args

    r = sub.add_parser("router", help="Route requests over many workers (cache-aware, round-robin, random, "
                       "power-of-two), with health checks, retries and backpressure.",
                       description="A router in front of radixserve (or SGLang-compatible) workers. See docs/router.md.",
                       epilog="examples:\n  radixserve router --worker-urls http://127.0.0.1:30001 "
                              "http://127.0.0.1:30002 --port 30000 --policy cache_aware\n"
                              "  radixserve router --pd-disaggregation --prefill http://127.0.0.1:30001 8998 "
                              "--decode http://127.0.0.1:30002 --port 30000",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    RouterArgs.add_cli_args(r)
    r.set_defaults(func=_router)

    la = sub.add_parser("launch", help="Start N workers and a router in front of them on this machine.",
                        description="One command for a fleet on one machine: --num-workers workers on the ports "
                                    "after --port, each with its share of the CPU threads, and the router on "
                                    "--port. Takes every engine option (passed to each worker) and every router "
                                    "option. Ctrl-C stops everything.",
                        epilog="example: radixserve launch --num-workers 2 --port 30000 --policy cache_aware")
    add_launch_args(la)
    la.set_defaults(func=_launch)


def _simulate_parser(sub: Any) -> None:
    from radixserve.sim.options import EPILOG as _SIM_EPILOG
    from radixserve.sim.options import add_args as _sim_args

    sm = sub.add_parser("simulate", help="Run the real scheduler against a cost-model GPU on a virtual clock.",
                        description="Simulate serving: the real Scheduler, RadixCache, allocators and policies over "
                                    "a runner whose step time comes from a cost model (no weights).",
                        epilog=_SIM_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    _sim_args(sm)
    sm.set_defaults(func=_simulate)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    parser = build_parser(args[0] if args and args[0] in COMMANDS else None)
    ns = parser.parse_args(args)
    return int(ns.func(ns) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
