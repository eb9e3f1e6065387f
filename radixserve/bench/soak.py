"""``radixserve bench soak``: many requests of mixed shapes against a real server, then a check that
nothing leaked.

The workload is drawn from ``--seed``: each request picks a route (``/v1/completions`` with token
ids, ``/v1/chat/completions`` with words, ``/generate`` with ``input_ids``), a prompt length (log-
normal around ``--prompt-len-median``, at most ``--max-prompt-len``), an output length (uniform in
1..``--max-output-len``, ``ignore_eos`` so it is exact), streaming or not, and a fate:

- ``normal``: completes, 200, with exactly the tokens asked for;
- ``abort``: a streamed ``/generate`` with a known rid, aborted through ``/abort_request`` after its
  first chunk (asks for 4x the output so it is still running then);
- ``disconnect``: a stream the client closes after its first chunk;
- ``invalid``: a body the server must refuse with a 4xx (bad values, unknown fields, a prompt past
  the context, malformed JSON).

Resident memory (the server's processes, from ``/proc``) is read at start, after ``--warmup``
requests of the same mix and at the end, each time once the server is idle. At the end the pools
must be back to their idle sizes: no KV slot protected or missing, every request slot free, and
after ``/flush_cache`` the whole KV pool free. Exits 1 on any leak, on any request that did not end
as its fate says, or on RSS growth after warm-up above ``--max-rss-growth``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

from radixserve.bench.subprocs import BenchError
from radixserve.bench.target import Target, add_target_args, memory_problems
from radixserve.results import write_result

DESCRIPTION = ("Starts a server (or targets --base-url) and sends --warmup, then --num-requests requests at "
               "--concurrency: prompt and output lengths drawn from --seed, streamed or not, over /v1/completions, "
               "/v1/chat/completions and /generate; some aborted through /abort_request after their first chunk, "
               "some whose client disconnects mid-stream, some invalid (each must be a 4xx). At the end, once idle, "
               "it checks that no KV slot or request slot leaked (/debug/memory, /get_load, /flush_cache frees the "
               "whole pool) and prints the server processes' resident memory (HTTP, scheduler, detokenizer) at "
               "start, after warm-up and at the end. Exits 1 on a leak, on a request that did not end as planned, "
               "or on RSS growth after warm-up above --max-rss-growth.")
DEFAULT_SERVER_ARGS = "--context-length 1024 --max-total-tokens 16384 --decode-log-interval 1000 --log-level warning"
ROUTES = ("/v1/completions", "/v1/chat/completions", "/generate")
WORDS = ("the cat sat on a mat while rain fell over quiet hills and rivers ran to the sea under grey "
         "skies in autumn light").split()


@dataclass
class Job:
    route: str
    fate: str  # normal, abort, disconnect, invalid
    stream: bool
    prompt_len: int
    output_len: int
    body: dict[str, Any] | bytes


def make_jobs(n: int, seed: int, ns: argparse.Namespace, vocab: int, context: int) -> list[Job]:
    rng = random.Random(seed)
    jobs = []
    fates = ("abort", "disconnect", "invalid")
    fracs = (ns.abort_frac, ns.disconnect_frac, ns.invalid_frac)
    for _ in range(n):
        x = rng.random()
        fate = "normal"
        for f, frac in zip(fates, fracs, strict=True):
            if x < frac:
                fate = f
                break
            x -= frac
        route = "/generate" if fate == "abort" else rng.choice(ROUTES)
        stream = fate in ("abort", "disconnect") or rng.random() < ns.stream_frac
        out = rng.randint(1, ns.max_output_len) * (4 if fate in ("abort", "disconnect") else 1)
        plen = min(ns.max_prompt_len, context - out - 1, max(1, int(rng.lognormvariate(math.log(ns.prompt_len_median), 0.8))))
        ids = [rng.randrange(vocab) for _ in range(plen)]
        body: dict[str, Any] | bytes
        if route == "/v1/completions":
            body = {"prompt": ids, "max_tokens": out, "ignore_eos": True, "temperature": 0, "stream": stream}
        elif route == "/v1/chat/completions":
            text = " ".join(rng.choice(WORDS) for _ in range(max(1, plen // 2)))
            body = {"messages": [{"role": "user", "content": text}], "max_tokens": out, "ignore_eos": True,
                    "temperature": 0.7, "seed": rng.randrange(1000), "stream": stream}
        else:
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": out, "ignore_eos": True, "temperature": 0},
                    "stream": stream, "rid": f"soak-{uuid.UUID(int=rng.getrandbits(128)).hex}"}
        if fate == "invalid":
            body = _invalid(rng, route, body, context)
        jobs.append(Job(route, fate, stream, plen, out, body))
    return jobs


def _invalid(rng: random.Random, route: str, body: dict[str, Any], context: int) -> dict[str, Any] | bytes:
    kind = rng.randrange(5)
    if kind == 0:
        return json.dumps(body).encode()[: rng.randrange(1, 40)]  # truncated JSON
    body = dict(body)
    if kind == 1:
        body["frobnicate"] = 1
    elif kind == 2:
        body["temperature" if route != "/generate" else "priority"] = "hot"
    elif kind == 3:
        key = {"/v1/completions": "prompt", "/v1/chat/completions": "messages", "/generate": "input_ids"}[route]
        body[key] = [1] * (context + 8) if route != "/v1/chat/completions" else []
    else:
        body["stream_options" if route != "/generate" else "top_logprobs_num"] = {"x": [1, 2]}
    return body


class Runner:
    def __init__(self, target: Target, timeout: float, deadline: float = math.inf) -> None:
        self.target = target
        self.timeout = timeout
        self.deadline = deadline  # time.monotonic() after which no new request starts
        self.outcomes: Counter[str] = Counter()
        self.problems: list[str] = []

    async def run(self, jobs: list[Job], concurrency: int, bar: Any) -> None:
        import httpx

        queue: asyncio.Queue[Job] = asyncio.Queue()
        for j in jobs:
            queue.put_nowait(j)
        limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
        async with httpx.AsyncClient(base_url=self.target.url, headers=self.target.headers, limits=limits,
                                     timeout=self.timeout) as client:

            async def worker() -> None:
                while not queue.empty() and time.monotonic() < self.deadline:
                    job = queue.get_nowait()
                    try:
                        verdict = await self.one(client, job)
                    except Exception as e:  # a transport error or a timeout is a failed request
                        verdict = f"error {type(e).__name__}: {e}"
                    if verdict.startswith(("error", "unexpected")):
                        self.outcomes[f"{job.fate}: failed"] += 1
                        if len(self.problems) < 50:
                            self.problems.append(f"{job.fate} {job.route} stream={job.stream}: {verdict}")
                    else:
                        self.outcomes[f"{job.fate}: {verdict}"] += 1
                    bar.update(1)

            await asyncio.gather(*(worker() for _ in range(concurrency)))

    async def one(self, client: Any, job: Job) -> str:
        if isinstance(job.body, bytes):
            r = await client.post(job.route, content=job.body, headers={"Content-Type": "application/json"})
            return "refused" if 400 <= r.status_code < 500 else f"unexpected {r.status_code}: {r.text[:200]}"
        if not job.stream:
            r = await client.post(job.route, json=job.body)
            if job.fate == "invalid":
                return "refused" if 400 <= r.status_code < 500 else f"unexpected {r.status_code}: {r.text[:200]}"
            if r.status_code != 200:
                return f"unexpected {r.status_code}: {r.text[:200]}"
            got = _completion_tokens(job.route, r.json())
            return "ok" if got == job.output_len else f"unexpected: {got} tokens, asked {job.output_len}"
        async with client.stream("POST", job.route, json=job.body) as r:
            if job.fate == "invalid":
                await r.aread()
                return "refused" if 400 <= r.status_code < 500 else f"unexpected {r.status_code}"
            if r.status_code != 200:
                return f"unexpected {r.status_code}: {(await r.aread())[:200]!r}"
            events = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                events += 1
                if line == "data: [DONE]":
                    break
                if events == 1 and job.fate == "disconnect":
                    return "disconnected"  # leaving the block closes the connection mid-stream
                if events == 1 and job.fate == "abort":
                    assert isinstance(job.body, dict)
                    a = await client.post("/abort_request", json={"rid": job.body["rid"]})
                    if a.status_code != 200:
                        return f"unexpected abort answer {a.status_code}: {a.text[:200]}"
            if job.fate == "abort":
                return "aborted"  # or finished before the abort reached it: both end the stream
            return "ok" if events >= 2 else f"unexpected: {events} events"


def _completion_tokens(route: str, out: dict[str, Any]) -> int | None:
    if route == "/generate":
        return int(out["meta_info"]["completion_tokens"])
    return int(out["usage"]["completion_tokens"])


def add_args(p: argparse.ArgumentParser) -> None:
    add_target_args(p, DEFAULT_SERVER_ARGS)
    p.add_argument("--num-requests", type=int, default=10000, help="Requests after warm-up.")
    p.add_argument("--warmup", type=int, default=500, help="Requests of the same mix before the warm-up RSS reading.")
    p.add_argument("--concurrency", type=int, default=16, help="Requests in flight.")
    p.add_argument("--seed", type=int, default=0, help="Workload seed (lengths, routes, fates, token ids).")
    p.add_argument("--prompt-len-median", type=int, default=48, help="Median prompt length in tokens (log-normal).")
    p.add_argument("--max-prompt-len", type=int, default=512, help="Longest prompt in tokens.")
    p.add_argument("--max-output-len", type=int, default=8,
                   help="Output lengths are uniform in 1..this (aborted and disconnected requests ask for 4x).")
    p.add_argument("--stream-frac", type=float, default=0.5, help="Share of normal and invalid requests streamed.")
    p.add_argument("--abort-frac", type=float, default=0.05, help="Share aborted through /abort_request mid-stream.")
    p.add_argument("--disconnect-frac", type=float, default=0.05, help="Share whose client disconnects mid-stream.")
    p.add_argument("--invalid-frac", type=float, default=0.05, help="Share of invalid requests (must get a 4xx).")
    p.add_argument("--max-rss-growth", type=float, default=5.0,
                   help="Fail if the server's total RSS grows more than this %% from after warm-up to the end.")
    p.add_argument("--max-duration", type=float, default=None,
                   help="Stop starting requests after this many seconds (warm-up included); the checks still "
                        "run, and the report says how many requests ran.")
    p.add_argument("--timeout", type=float, default=300.0, help="Per-request timeout (s).")
    p.add_argument("--output", default=None, help="Write the results as JSON here.")
    p.add_argument("--disable-tqdm", action="store_true", help="No progress bar.")


def settle(target: Target) -> tuple[dict[str, Any], dict[str, float] | None]:
    """Idle memory state and RSS (MiB per process) once nothing runs."""
    mem = target.wait_idle()
    return mem, target.rss_mb()


def run(target: Target, ns: argparse.Namespace) -> dict[str, Any]:
    """The soak against a ready ``target``; the results, with ``ok`` and ``problems``."""
    from tqdm import tqdm

    context = target.context_len
    jobs = make_jobs(ns.warmup + ns.num_requests, ns.seed, ns, target.vocab_size, context)
    res: dict[str, Any] = {"num_requests": ns.num_requests, "warmup": ns.warmup, "concurrency": ns.concurrency}
    _, rss_start = settle(target)
    runner = Runner(target, ns.timeout, time.monotonic() + (ns.max_duration or math.inf))
    t0 = time.perf_counter()
    with tqdm(total=len(jobs), desc="soak", unit="req", disable=ns.disable_tqdm) as bar:
        asyncio.run(runner.run(jobs[:ns.warmup], ns.concurrency, bar))
        _, rss_warm = settle(target)
        t1 = time.perf_counter()
        asyncio.run(runner.run(jobs[ns.warmup:], ns.concurrency, bar))
    res["elapsed_s"] = round(time.perf_counter() - t0, 1)
    res["main_phase_s"] = round(time.perf_counter() - t1, 1)
    res["requests_run"] = sum(runner.outcomes.values()) - ns.warmup
    mem, rss_end = settle(target)
    load = target.client.get("/get_load").json()
    problems = list(runner.problems) + memory_problems(mem)
    if any(r.get("num_reqs") for r in load):
        problems.append(f"requests left in the scheduler: {load}")
    flushed = target.client.post("/flush_cache")
    after_flush = target.client.get("/debug/memory").json()
    if flushed.status_code != 200 or after_flush["available"] != after_flush["total"]:
        problems.append(f"after /flush_cache the KV pool is not all free: {after_flush} ({flushed.status_code})")
    res.update(outcomes=dict(sorted(runner.outcomes.items())), memory_end=mem, memory_after_flush=after_flush,
               rss_mb={"start": rss_start, "after_warmup": rss_warm, "end": rss_end})
    if rss_warm and rss_end:
        warm, end = sum(rss_warm.values()), sum(rss_end.values())
        res["rss_growth_pct"] = round(100 * (end - warm) / warm, 2)
        if res["rss_growth_pct"] > ns.max_rss_growth:
            problems.append(f"RSS grew {res['rss_growth_pct']}% after warm-up (limit {ns.max_rss_growth}%)")
    if not target.alive():
        problems.append("the server process exited")
    res["problems"] = problems
    res["ok"] = not problems
    return res


def _fmt_rss(r: dict[str, float] | None) -> str:
    if not r:
        return "n/a"
    return f"{sum(r.values()):.0f} MiB (" + ", ".join(f"{k} {v:.0f}" for k, v in r.items()) + ")"


def main(ns: argparse.Namespace) -> int:
    target = Target(ns)
    try:
        target.wait_ready()
        res = run(target, ns)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        target.stop()
    cut = " (stopped by --max-duration)" if res["requests_run"] < ns.num_requests else ""
    print(f"\n{ns.warmup} warm-up + {res['requests_run']} of {ns.num_requests} requests{cut} at concurrency "
          f"{ns.concurrency} in {res['elapsed_s']} s (main phase {res['main_phase_s']} s)")
    for k, v in res["outcomes"].items():
        print(f"  {v:6d}  {k}")
    m = res["memory_end"]
    print(f"pools at the end (idle): KV {m['available']} free + {m['evictable']} cached of {m['total']}, "
          f"{m['protected']} protected; request slots {m['req_slots_free']} / {m['req_slots_total']} free; "
          f"after /flush_cache {res['memory_after_flush']['available']} / {res['memory_after_flush']['total']} free")
    rss = res["rss_mb"]
    print(f"RSS start {_fmt_rss(rss['start'])}\n    after warm-up {_fmt_rss(rss['after_warmup'])}\n"
          f"    end {_fmt_rss(rss['end'])}\n    growth after warm-up: {res.get('rss_growth_pct', 'n/a')}%")
    if ns.output:
        write_result(ns.output, res)
    for p in res["problems"]:
        print(f"problem: {p}")
    print("PASS" if res["ok"] else "FAIL")
    return 0 if res["ok"] else 1
