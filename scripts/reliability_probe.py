"""The long versions of two reliability tests, against a running server on this machine; prints
what it measured.

    radixserve serve --port 30000 --max-running-requests 2 --max-queued-requests 2 &
    python scripts/reliability_probe.py burst --base-url http://127.0.0.1:30000 --rounds 5
    python scripts/reliability_probe.py disconnect --base-url http://127.0.0.1:30000 --trials 20

``burst``: rounds of ``--factor`` x (running + queued limit) concurrent completions (half of them
streamed): each accepted one must come back with all its tokens, each refused one with 429 and a
Retry-After; after each round the engine must be idle with its memory invariant intact. Prints
the counts, the slowest refusal, and the server processes' resident memory after every round.

``disconnect``: a streamed request cut by its client a few tokens in, ``--trials`` times (and as
many non-streaming ones cut while they run): prints how many scheduler steps ran after the client
left before the request was gone and its KV free (``/get_load``'s ``forward_steps``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import time
from typing import Any
from urllib.parse import urlparse

import httpx


def rss_mib(pids: dict[str, int]) -> dict[str, float]:
    out = {}
    for name, pid in pids.items():
        try:
            with open(f"/proc/{pid}/status") as f:
                kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            continue  # not on this machine
        out[name] = kb / 1024
    return out


def wait_idle(c: httpx.Client, timeout: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if c.get("/get_load").json()[0]["num_reqs"] == 0:
            mem = c.get("/debug/memory").json()
            if mem["idle"]:
                return dict(mem)
        time.sleep(0.05)
    raise SystemExit(f"not idle after {timeout} s")


def memory_ok(mem: dict[str, Any]) -> bool:
    return bool(mem["invariant_ok"] and mem["protected"] == 0 and mem["req_slots_free"] == mem["req_slots_total"]
                and mem["available"] + mem["evictable"] == mem["total"])


async def one(client: httpx.AsyncClient, i: int, tokens: int, stream: bool) -> tuple[str, float]:
    body: dict[str, Any] = {"prompt": f"Request number {i}:", "max_tokens": tokens, "ignore_eos": True,
                            "stream": stream}
    t0 = time.perf_counter()
    if stream:
        body["stream_options"] = {"include_usage": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return _refused(r), time.perf_counter() - t0
            got = 0
            async for line in r.aiter_lines():
                if line.startswith("data:") and line[5:].strip() != "[DONE]":
                    event = json.loads(line[5:])
                    if "error" in event:
                        return "error", time.perf_counter() - t0
                    if event.get("usage"):
                        got = event["usage"]["completion_tokens"]
            return ("done" if got == tokens else "short"), time.perf_counter() - t0
    r = await client.post("/v1/completions", json=body)
    if r.status_code != 200:
        return _refused(r), time.perf_counter() - t0
    ok = r.json()["usage"]["completion_tokens"] == tokens
    return ("done" if ok else "short"), time.perf_counter() - t0


def _refused(r: httpx.Response) -> str:
    return "refused" if r.status_code == 429 and int(r.headers.get("retry-after", "0")) > 0 else f"http_{r.status_code}"


def burst(ns: argparse.Namespace, c: httpx.Client) -> int:
    info = c.get("/get_server_info").json()
    held = (info.get("max_running_requests") or 0) + (info.get("max_queued_requests") or 0)
    if not info.get("max_queued_requests"):
        print("the server has no --max-queued-requests: nothing would be refused", file=sys.stderr)
        return 2
    n = ns.factor * held
    pids = info["pids"]
    print(f"server holds {held} (running + queued); {ns.rounds} rounds of {n} concurrent requests")
    print(f"RSS MiB before: {_fmt(rss_mib(pids))}")
    failures = 0

    async def round_() -> list[tuple[str, float]]:
        headers = c.headers
        limits = httpx.Limits(max_connections=n + 8)
        async with httpx.AsyncClient(base_url=ns.base_url, headers=headers, timeout=120, limits=limits) as ac:
            return await asyncio.gather(*(one(ac, i, ns.max_tokens, i % 2 == 0) for i in range(n)))

    for k in range(ns.rounds):
        t0 = time.perf_counter()
        results = asyncio.run(round_())
        wall = time.perf_counter() - t0
        kinds = [kind for kind, _ in results]
        slowest_refusal = max((s for kind, s in results if kind == "refused"), default=0.0)
        mem = wait_idle(c)
        ok = memory_ok(mem) and set(kinds) <= {"done", "refused"}
        failures += not ok
        print(f"round {k + 1}: {kinds.count('done')} done, {kinds.count('refused')} refused (429 + Retry-After), "
              f"other {len(kinds) - kinds.count('done') - kinds.count('refused')}; {wall:.1f} s; slowest refusal "
              f"{slowest_refusal * 1e3:.0f} ms; idle, memory {'ok' if memory_ok(mem) else 'BROKEN'}; "
              f"RSS MiB {_fmt(rss_mib(pids))}")
    return 1 if failures else 0


def disconnect(ns: argparse.Namespace, c: httpx.Client) -> int:
    def steps() -> int:
        return int(c.get("/get_load").json()[0]["forward_steps"])

    streamed, plain = [], []
    for _ in range(ns.trials):
        with httpx.Client(base_url=ns.base_url, headers=c.headers, timeout=60) as other:
            body = {"prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True, "stream": True}
            with other.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                for _ in range(3):
                    next(ln for ln in lines if ln.startswith("data:"))
                before = steps()
        ok = memory_ok(wait_idle(c))
        streamed.append((steps() - before, ok))
    u = urlparse(ns.base_url)
    raw = json.dumps({"text": "Once upon a time", "sampling_params": {"max_new_tokens": 4000,
                                                                       "ignore_eos": True}}).encode()
    auth = "".join(f"{k}: {v}\r\n" for k, v in c.headers.items() if k.lower() == "authorization").encode()
    for _ in range(ns.trials):
        with socket.create_connection((u.hostname or "127.0.0.1", u.port or 80)) as s:
            s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + auth +
                      b"Content-Length: %d\r\n\r\n%s" % (len(raw), raw))
            while c.get("/get_load").json()[0]["num_reqs"] == 0:
                time.sleep(0.02)
            start = steps()
            while steps() < start + 3:
                time.sleep(0.02)
            before = steps()
        ok = memory_ok(wait_idle(c))
        plain.append((steps() - before, ok))
    for name, got in (("streamed", streamed), ("non-streaming", plain)):
        counts = sorted(n for n, _ in got)
        print(f"{name}: steps after the client left, over {len(got)} trials: min {counts[0]}, "
              f"median {counts[len(counts) // 2]}, max {counts[-1]}; memory ok after each: "
              f"{all(ok for _, ok in got)}")
    return 0 if all(ok for _, ok in streamed + plain) else 1


def _fmt(rss: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.0f}" for k, v in rss.items()) + f" (total {sum(rss.values()):.0f})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("what", choices=("burst", "disconnect"))
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--api-key", default=None)
    p.add_argument("--rounds", type=int, default=5, help="burst: rounds")
    p.add_argument("--factor", type=int, default=20, help="burst: requests per round, times what the server holds")
    p.add_argument("--max-tokens", type=int, default=6, help="burst: tokens per request")
    p.add_argument("--trials", type=int, default=20, help="disconnect: trials of each kind")
    ns = p.parse_args()
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    with httpx.Client(base_url=ns.base_url, headers=headers, timeout=60) as c:
        return burst(ns, c) if ns.what == "burst" else disconnect(ns, c)


if __name__ == "__main__":
    sys.exit(main())
