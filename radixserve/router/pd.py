"""Prefill/decode disaggregation at the router (``--pd-disaggregation``), as sgl-router does it.

For each request the router picks a prefill worker (``--prefill-policy``) and a decode worker
(``--decode-policy``), draws a ``bootstrap_room`` (a random 63-bit integer naming this KV
hand-over) and sends the same body to both at once, adding

    bootstrap_host, bootstrap_port   the prefill worker's host and bootstrap port
    bootstrap_room                   the room
    data_parallel_rank               with --dp-aware: the prefill rank (to both)
    data_parallel_rank_decode        with --dp-aware: the decode rank (to the decode worker)

The decode worker's answer goes to the client (streamed as it comes); the prefill worker's is read
and dropped. Its load is released as soon as its answer ends, that is when the prompt is done.

Failures, while the client has been sent nothing: the decode side failing (connection error, 5xx,
429) or the prefill side failing (the decode worker would wait for a room that never comes) both
cancel the other side (closing its connection makes that worker abort the request and free its
KV) and retry the pair, with other workers where there are some. A 4xx from the prefill side is
the request's fault: the decode side is cancelled and the prefill worker's answer returned.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any, Protocol
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from radixserve.router.config import RouterArgs
from radixserve.router.fleet import Fleet
from radixserve.router.http_common import STREAMED, error_body, error_response, json_object
from radixserve.router.metrics import RouterMetrics
from radixserve.router.policy import NoTargetMeetsDeadline, RouteRequest, RouterPolicy, Target
from radixserve.router.worker import Worker


class Router(Protocol):
    """What a prefill/decode pair needs of the router (``router.Router``)."""

    args: RouterArgs
    fleet: Fleet
    metrics: RouterMetrics
    policies: dict[str | None, RouterPolicy]
    needs_key: bool
    rng: random.Random

    @property
    def workers(self) -> dict[str, Worker]: ...

    @property
    def session(self) -> aiohttp.ClientSession | None: ...

    def route_request(self, path: str, body: dict[str, Any], headers: Any = None) -> RouteRequest: ...

    def upstream_headers(self, request: web.Request) -> dict[str, str]: ...

    def count_failure(self, worker: Worker, e: BaseException) -> None: ...

    async def backoff(self, attempt: int) -> None: ...

    async def send(self, request: web.Request, path: str, worker: Worker, target: Target, payload: bytes,
                   headers: dict[str, str], last: bool) -> web.StreamResponse | str: ...


async def proxy_pd(router: Router, request: web.Request, path: str, raw: bytes, t0: float) -> web.StreamResponse:
    body = json_object(raw)
    if isinstance(body, web.Response):
        return body
    rreq = router.route_request(path, body, request.headers) if router.needs_key else RouteRequest()
    headers = router.upstream_headers(request)
    tried_p: set[str] = set()
    tried_d: set[str] = set()
    attempt = 0
    last_reason = ""
    while True:
        prefills = router.fleet.eligible(tried_p, role="prefill")
        decodes = router.fleet.eligible(tried_d, role="decode")
        if not prefills or not decodes:
            router.metrics.rejected.labels("no_worker").inc()
            which = "prefill" if not prefills else "decode"
            return error_response(f"No healthy {which} worker is available.", 503, "no_healthy_worker",
                                  {"Retry-After": "1"})
        try:
            p = _select(router, "prefill", prefills, rreq)
            d = _select(router, "decode", decodes, rreq)
        except NoTargetMeetsDeadline as e:
            router.metrics.rejected.labels("deadline").inc()
            return web.json_response(error_body(str(e), 429, "deadline_unmeetable", "rate_limit_error"),
                                     status=429, headers={"Retry-After": "1"})
        pw, dw = router.workers[p.url], router.workers[d.url]
        tried_p.add(pw.url)
        tried_d.add(dw.url)
        if pw.bootstrap_port is None:
            return error_response(f"prefill worker {pw.url} reports no bootstrap port; give it as "
                                  "--prefill URL BOOTSTRAP_PORT", 502, "bad_gateway")
        room = router.rng.getrandbits(63)
        extra: dict[str, Any] = {"bootstrap_host": urlsplit(pw.url).hostname, "bootstrap_port": pw.bootstrap_port,
                                 "bootstrap_room": room}
        if p.dp_rank is not None:
            extra["data_parallel_rank"] = p.dp_rank
        dextra = dict(extra)
        if d.dp_rank is not None:
            dextra["data_parallel_rank_decode"] = d.dp_rank
        if attempt == 0:
            router.metrics.overhead.observe(time.perf_counter() - t0)
        last = attempt >= router.args.retry_max_retries
        prefill = asyncio.create_task(_prefill(router, pw, p, path, json.dumps({**body, **extra}).encode(), headers))
        decode = asyncio.create_task(router.send(request, path, dw, d, json.dumps({**body, **dextra}).encode(),
                                                 headers, last=last))
        try:
            done, _ = await asyncio.wait({prefill, decode}, return_when=asyncio.FIRST_COMPLETED)
            if prefill in done and decode not in done:
                failed = prefill.result()
                if failed is not None and not request.get(STREAMED):
                    await _cancel(decode)
                    if isinstance(failed, web.Response):  # the request's own fault: say so
                        return failed
                    outcome: web.StreamResponse | str = failed
                else:
                    outcome = await decode
            else:
                outcome = await decode
        finally:  # normally both are done; else (a failure, or the client went away) closing the
            # connection makes that worker abort the request and free its KV
            await _cancel(prefill)
            await _cancel(decode)
        if isinstance(outcome, web.StreamResponse):
            return outcome
        last_reason = outcome
        if last:
            return error_response(f"prefill/decode pair failed: {last_reason}", 502, "bad_gateway")
        attempt += 1
        router.metrics.retries.labels(outcome).inc()
        await router.backoff(attempt)


def _select(router: Router, role: str, targets: list[Target], rreq: RouteRequest) -> Target:
    policy = router.policies[role]
    decision = policy.select(targets, rreq)
    router.metrics.decisions.labels(f"{role}:{policy.name}", decision.branch).inc()
    return decision.target


async def _prefill(router: Router, worker: Worker, target: Target, path: str, payload: bytes,
                   headers: dict[str, str]) -> str | web.Response | None:
    """Run the prefill side to its end. None: done; a string: why to retry the pair; a response:
    the prefill worker refused the request itself (4xx), to pass on."""

    assert router.session is not None
    target.load += 1
    worker.breaker.on_send()
    router.metrics.requests.labels(worker.url, path).inc()
    try:
        async with router.session.post(worker.url + path, data=payload, headers=headers) as r:
            data = await r.read()
            if r.status >= 500 or r.status == 429:
                if r.status >= 500:
                    worker.breaker.record_failure(time.monotonic())
                return f"prefill_status_{'429' if r.status == 429 else '5xx'}"
            worker.breaker.record_success()
            if r.status >= 400:
                return web.Response(body=data, status=r.status,
                                    headers={"Content-Type": r.headers.get("Content-Type", "application/json")})
            return None
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        router.count_failure(worker, e)
        return "prefill_connection_error"
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - a broken answer from the worker: retry elsewhere
        return error_response(f"prefill worker {worker.url}: {e}", 502, "bad_gateway")
    finally:
        target.load -= 1


async def _cancel(task: asyncio.Task[Any]) -> None:
    if not task.done():
        task.cancel()
    await asyncio.gather(task, return_exceptions=True)
