"""``radixserve bench serve``: load-test any OpenAI-compatible server, as SGLang's bench_serving.

The workloads of ``bench/workloads.py`` (token ids, the same prompts the offline benchmark runs)
go to ``/v1/completions`` as ``prompt`` token-id lists with ``ignore_eos`` and ``max_tokens``,
streamed, so that every request's TTFT and inter-token latencies can be measured:

- arrivals: a Poisson process at ``--request-rate`` req/s (``inf``: all at once), at most
  ``--max-concurrency`` in flight;
- multi-turn: a conversation's turn t is sent only after its turn t-1 has finished, and its prompt
  is turn t-1's prompt + the reply the server generated (its token ids, asked for with vLLM's
  ``return_token_ids``) + the turn's new user tokens: every turn extends the previous one exactly,
  as a chat does, and the server's prefix cache can hit on the whole history (``cached_tokens``,
  from ``usage.prompt_tokens_details``, is reported per request). A server that returns no token
  ids gets the workload's random stand-in for the reply instead (counted in the report). With
  ``--think-time`` a turn waits that long on average (exponentially distributed) after the previous
  one finished, as a user reads or an agent's tool runs: other conversations' turns push its
  history out of a small KV pool meanwhile;
- reported: request / token throughput and P50 / P95 / P99 of TTFT, TPOT (per request, time per
  output token after the first), ITL (every gap between streamed chunks) and end-to-end latency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
from tqdm import tqdm

from radixserve.bench.workloads import WORKLOADS, BenchRequest, make_workload
from radixserve.results import write_result


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:30000", help="Server URL (no /v1).")
    p.add_argument("--model", default=None, help="Model name to send (default: the first of /v1/models).")
    p.add_argument("--api-key", default=None, help="Sent as 'Authorization: Bearer <key>'.")
    p.add_argument("--workload", choices=WORKLOADS, default="random", help="Which workload.")
    p.add_argument("--num-prompts", type=int, default=64, help="random: prompts; shared-prefix: prompts per group; "
                   "multi-turn: conversations.")
    p.add_argument("--input-len", type=int, default=256, help="random: prompt tokens; multi-turn: first turn.")
    p.add_argument("--output-len", type=int, default=64, help="Tokens generated per request (max_tokens).")
    p.add_argument("--num-groups", type=int, default=8, help="shared-prefix: groups (distinct system prompts).")
    p.add_argument("--system-len", type=int, default=512, help="shared-prefix: system prompt tokens.")
    p.add_argument("--question-len", type=int, default=64, help="shared-prefix: question tokens.")
    p.add_argument("--num-turns", type=int, default=4, help="multi-turn: turns per conversation.")
    p.add_argument("--turn-len", type=int, default=64, help="multi-turn: new user tokens per turn.")
    p.add_argument("--think-time", type=float, default=0.0,
                   help="multi-turn: mean seconds between a turn's end and the next turn (exponential; 0: none).")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="Token ids are drawn below this (default: /get_model_info's vocab_size, else 32000).")
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrival rate (req/s); inf = burst.")
    p.add_argument("--max-concurrency", type=int, default=None, help="Most requests in flight.")
    p.add_argument("--temperature", type=float, default=0.0, help="Sampling temperature sent.")
    p.add_argument("--seed", type=int, default=0, help="Workload and arrival seed.")
    p.add_argument("--timeout", type=float, default=600.0, help="Per-request timeout (s).")
    p.add_argument("--output", default=None, help="Write the results as JSON here.")
    p.add_argument("--plot", default=None, help="Write a PNG of the latency distributions here.")
    p.add_argument("--disable-tqdm", action="store_true", help="No progress bar.")


@dataclass
class RequestResult:
    ok: bool
    prompt_len: int
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0
    error: str | None = None
    status: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when the server says
    group: int = 0
    turn: int = 0

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens <= 1:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _summary(xs: list[float]) -> dict[str, float | None]:
    ms = [x * 1000 for x in xs]
    return {
        "mean_ms": sum(ms) / len(ms) if ms else None,
        "p50_ms": percentile(ms, 50),
        "p95_ms": percentile(ms, 95),
        "p99_ms": percentile(ms, 99),
    }


class ServingBenchmark:
    def __init__(self, ns: argparse.Namespace) -> None:
        self.ns = ns
        self.base = ns.base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
        self.replies = {"real": 0, "stand_in": 0}  # multi-turn: where each turn's reply tokens came from

    async def _discover(self, client: httpx.AsyncClient) -> tuple[str, int]:
        model = self.ns.model
        if model is None:
            r = await client.get(f"{self.base}/v1/models")
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        vocab = self.ns.vocab_size
        if vocab is None:
            try:
                r = await client.get(f"{self.base}/get_model_info")
                vocab = int(r.json()["vocab_size"]) if r.status_code == 200 else None
            except (httpx.HTTPError, KeyError, TypeError, ValueError):
                vocab = None
        return model, vocab or 32000

    def workload(self, vocab: int) -> list[BenchRequest]:
        ns = self.ns
        common: dict[str, int] = {"vocab": vocab, "seed": ns.seed, "output_len": ns.output_len}
        if ns.workload == "random":
            return make_workload("random", num_prompts=ns.num_prompts, input_len=ns.input_len, **common)
        if ns.workload == "shared-prefix":
            return make_workload("shared-prefix", num_groups=ns.num_groups, prompts_per_group=ns.num_prompts,
                                 system_len=ns.system_len, question_len=ns.question_len, **common)
        return make_workload("multi-turn", num_conversations=ns.num_prompts, num_turns=ns.num_turns,
                             first_len=ns.input_len, turn_len=ns.turn_len, **common)

    async def send(self, client: httpx.AsyncClient, model: str, req: BenchRequest, prompt: list[int],
                   reply_ids: list[int] | None = None) -> RequestResult:
        """Stream one request; with ``reply_ids``, ask for the generated token ids and gather them there."""
        payload: dict[str, Any] = {
            "model": model, "prompt": prompt, "max_tokens": req.max_new_tokens, "ignore_eos": True,
            "temperature": self.ns.temperature, "stream": True, "stream_options": {"include_usage": True},
        }
        if reply_ids is not None:
            payload["return_token_ids"] = True
        res = RequestResult(False, len(prompt), group=req.group, turn=req.turn)
        t0 = res.start = time.perf_counter()
        last = t0
        chunks = 0
        try:
            async with client.stream("POST", f"{self.base}/v1/completions", json=payload, headers=self.headers,
                                     timeout=self.ns.timeout) as resp:
                res.status = resp.status_code
                if resp.status_code != 200:
                    body = (await resp.aread()).decode(errors="replace")
                    res.error = f"HTTP {resp.status_code}: {body[:200]}"
                    return res
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    msg = json.loads(data)
                    if "error" in msg:
                        res.error = str(msg["error"].get("message"))
                        return res
                    now = time.perf_counter()
                    if msg.get("choices"):
                        chunks += 1
                        if reply_ids is not None:
                            reply_ids.extend(msg["choices"][0].get("token_ids") or [])
                        if res.ttft is None:
                            res.ttft = now - t0
                        else:
                            res.itl.append(now - last)
                        last = now
                    if msg.get("usage"):
                        res.output_tokens = int(msg["usage"]["completion_tokens"])
                        details = msg["usage"].get("prompt_tokens_details") or {}
                        if details.get("cached_tokens") is not None:
                            res.cached_tokens = int(details["cached_tokens"])
        except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
            res.error = f"{type(e).__name__}: {e}"
            return res
        res.e2e = time.perf_counter() - t0
        res.output_tokens = res.output_tokens or chunks
        res.ok = True
        return res

    async def run(self) -> dict[str, Any]:
        ns = self.ns
        limits = httpx.Limits(max_connections=ns.max_concurrency or 1024, max_keepalive_connections=64)
        async with httpx.AsyncClient(limits=limits, headers=self.headers, timeout=ns.timeout) as client:
            model, vocab = await self._discover(client)
            reqs = self.workload(vocab)
            rng = random.Random(ns.seed)
            sem = asyncio.Semaphore(ns.max_concurrency) if ns.max_concurrency else None
            multi_turn = ns.workload == "multi-turn"
            turn_done: dict[tuple[int, int], asyncio.Event] = {(r.group, r.turn): asyncio.Event() for r in reqs}
            history: dict[int, list[int]] = {}  # multi-turn: a conversation's last prompt + its real reply
            # the workload's stand-in for the reply to turn t travels with turn t + 1
            stand_in = {(r.group, r.turn - 1): r.stand_in_reply for r in reqs if r.turn > 0}
            think = {(r.group, r.turn): rng.expovariate(1 / ns.think_time) if ns.think_time > 0 else 0.0 for r in reqs}
            bar = tqdm(total=len(reqs), desc=f"bench {ns.workload}", disable=ns.disable_tqdm, file=sys.stderr)
            results: list[RequestResult] = []

            async def one(req: BenchRequest, delay: float) -> None:
                await asyncio.sleep(delay)
                prompt = req.input_ids
                if multi_turn and req.turn > 0:
                    await turn_done[(req.group, req.turn - 1)].wait()
                    await asyncio.sleep(think[(req.group, req.turn)])
                    if req.group in history:  # else turn t-1 broke down: the workload's own prompt
                        prompt = history[req.group] + req.user_ids
                reply: list[int] | None = [] if multi_turn else None
                try:
                    if sem is not None:
                        async with sem:
                            res = await self.send(client, model, req, prompt, reply)
                    else:
                        res = await self.send(client, model, req, prompt, reply)
                    if reply is not None:
                        real = res.ok and bool(reply)
                        if res.ok:
                            self.replies["real" if real else "stand_in"] += 1
                        history[req.group] = prompt + (reply if real else stand_in.get((req.group, req.turn), []))
                finally:
                    turn_done[(req.group, req.turn)].set()
                results.append(res)
                bar.update(1)

            delays, t = [], 0.0
            for _ in reqs:
                delays.append(t)
                if math.isfinite(ns.request_rate) and ns.request_rate > 0:
                    t += rng.expovariate(ns.request_rate)
            t0 = time.perf_counter()
            await asyncio.gather(*(one(r, d) for r, d in zip(reqs, delays, strict=True)))
            duration = time.perf_counter() - t0
            bar.close()
        return self.report(model, results, duration)

    def report(self, model: str, results: list[RequestResult], duration: float) -> dict[str, Any]:
        ok = [r for r in results if r.ok]
        errors: dict[str, int] = {}
        for r in results:
            if not r.ok:
                key = f"HTTP {r.status}" if r.status and r.status != 200 else (r.error or "error")[:80]
                errors[key] = errors.get(key, 0) + 1
        out_tokens = sum(r.output_tokens for r in ok)
        in_tokens = sum(r.prompt_len for r in ok)
        # the hit rate counts only requests whose server said how many of their tokens were cached
        told = [r for r in ok if r.cached_tokens is not None]
        cached_tokens = sum(r.cached_tokens or 0 for r in told)
        told_prompt = sum(r.prompt_len for r in told)
        ns = self.ns
        return {
            "base_url": self.base, "model": model, "workload": ns.workload,
            "request_rate": ns.request_rate if math.isfinite(ns.request_rate) else "inf",
            "max_concurrency": ns.max_concurrency,
            "num_requests": len(results), "completed": len(ok), "failed": len(results) - len(ok), "errors": errors,
            "duration_s": duration,
            "request_throughput": len(ok) / duration if duration else 0.0,
            "input_throughput": in_tokens / duration if duration else 0.0,
            "output_throughput": out_tokens / duration if duration else 0.0,
            "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
            "total_cached_tokens": cached_tokens if told else None,
            "cache_hit_rate": cached_tokens / told_prompt if told_prompt else None,
            "ttft": _summary([r.ttft for r in ok if r.ttft is not None]),
            "tpot": _summary([t for r in ok if (t := r.tpot) is not None]),
            "itl": _summary([x for r in ok for x in r.itl]),
            "e2e_latency": _summary([r.e2e for r in ok]),
            **({"multi_turn_replies": dict(self.replies)} if ns.workload == "multi-turn" else {}),
            "requests": [asdict(r) for r in results],
        }


def print_report(rep: dict[str, Any]) -> None:
    w = 44
    print(f"{' Serving Benchmark Result ':=^{w + 12}}")
    rows: list[tuple[str, Any]] = [
        ("Workload", rep["workload"]), ("Request rate (req/s)", rep["request_rate"]),
        ("Max concurrency", rep["max_concurrency"]), ("Successful requests", rep["completed"]),
        ("Failed requests", rep["failed"]), ("Benchmark duration (s)", rep["duration_s"]),
        ("Total input tokens", rep["total_input_tokens"]), ("Total generated tokens", rep["total_output_tokens"]),
        ("Request throughput (req/s)", rep["request_throughput"]),
        ("Input token throughput (tok/s)", rep["input_throughput"]),
        ("Output token throughput (tok/s)", rep["output_throughput"]),
        ("Cache hit rate (cached / prompt tokens)",
         "-" if rep["cache_hit_rate"] is None else f"{rep['cache_hit_rate']:.1%}"),
    ]
    for name, key in (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("E2E latency", "e2e_latency")):
        for stat in ("mean_ms", "p50_ms", "p95_ms", "p99_ms"):
            rows.append((f"{name} {stat.replace('_ms', '')} (ms)", rep[key][stat]))
    for name, val in rows:
        txt = f"{val:.2f}" if isinstance(val, float) else str(val)
        print(f"{name:<{w}}{txt:>12}")
    if rep["errors"]:
        print(f"{'Errors':<{w}}{json.dumps(rep['errors'])}")
    print("=" * (w + 12))


def plot(rep: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reqs = [r for r in rep["requests"] if r["ok"]]
    series = {
        "TTFT (ms)": [r["ttft"] * 1000 for r in reqs if r["ttft"] is not None],
        "TPOT (ms)": [(r["e2e"] - r["ttft"]) / (r["output_tokens"] - 1) * 1000 for r in reqs
                      if r["ttft"] is not None and r["output_tokens"] > 1],
        "ITL (ms)": [x * 1000 for r in reqs for x in r["itl"]],
        "E2E latency (s)": [r["e2e"] for r in reqs],
    }
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, (name, xs) in zip(axes.flat, series.items(), strict=True):
        if xs:
            ax.hist(xs, bins=min(40, max(5, len(xs) // 2)), color="#4472c4", alpha=0.85)
            for q, style in ((50, "-"), (95, "--"), (99, ":")):
                v = percentile(xs, q)
                if v is not None:
                    ax.axvline(v, color="#c00000", linestyle=style, label=f"P{q} {v:.1f}")
            ax.legend(fontsize=8)
        ax.set_title(name)
        ax.set_ylabel("count")
    fig.suptitle(f"{rep['workload']} @ {rep['request_rate']} req/s, concurrency {rep['max_concurrency']}: "
                 f"{rep['output_throughput']:.1f} output tok/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(ns: argparse.Namespace) -> int:
    rep = asyncio.run(ServingBenchmark(ns).run())
    print_report(rep)
    if ns.output:
        write_result(ns.output, rep)
    if ns.plot:
        plot(rep, ns.plot)
    return 0 if rep["completed"] else 1
