"""``Router``: the fleet, the policy and the request path of ``radixserve router``.

One request's path (``proxy``):

    admission slot (or 429) -> parse the body only if the policy or --dp-aware needs it
      -> routing key (text, or token ids with --prefix-match tokens) -> policy.select(eligible targets)
      -> target.load += 1 -> POST to the worker (keep-alive pool)
           connection error / 5xx / 429 -> retry on another worker after a backoff, while the
                                           client has been sent nothing
           otherwise -> pass the answer through (SSE chunk by chunk as it comes, never buffered)
      -> target.load -= 1 in ``finally``: on success, error, timeout or the client going away

A target is eligible when its worker passes its health checks and its circuit breaker is not
open (``fleet.Fleet`` keeps the workers, their health and loads; a connection error on the
request path has it check that worker at once). ``pd.py`` is the prefill/decode variant.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Sequence
from typing import Any

import aiohttp
from aiohttp import web

from radixserve.options import parse_tenant_weights
from radixserve.router.admission import NO_PRIORITY_RANK, Admission, TenantCounters
from radixserve.router.affinity import SessionAffinity, decide, routing_key
from radixserve.router.config import RouterArgs
from radixserve.router.fleet import Fleet
from radixserve.router.http_common import STREAMED, error_body, error_response, json_object
from radixserve.router.metrics import RouterMetrics
from radixserve.router.pd import proxy_pd
from radixserve.router.policy import (
    NoTargetMeetsDeadline,
    PolicyConfig,
    RouteRequest,
    RouterPolicy,
    Target,
    make_router_policy,
)
from radixserve.router.rate_limits import RateLimits
from radixserve.router.request_keys import prompt_key
from radixserve.router.response_homes import RESPONSE_ID_HEADER, ResponseHomes
from radixserve.router.worker import Worker

logger = logging.getLogger("radixserve.router")

# request headers not passed on to a worker (hop-by-hop, or set by the router itself)
_DROP_REQ = frozenset({"host", "content-length", "connection", "keep-alive", "transfer-encoding", "authorization",
                       "x-api-key", "accept-encoding", "te", "upgrade", "proxy-authorization"})
DEFAULT_OUTPUT_TOKENS = 128  # a request's output estimate for --tenant-fairness when it gives none
_KEEP_RESP = ("content-type", "retry-after", "x-request-id", "cache-control", "x-response-id")


class Router:
    def __init__(self, args: RouterArgs) -> None:
        self.args = args
        config = PolicyConfig(
            cache_threshold=args.cache_threshold, balance_abs_threshold=args.balance_abs_threshold,
            balance_rel_threshold=args.balance_rel_threshold, max_tree_size=args.max_tree_size,
            balance_affinity=args.balance_affinity, miss_by_load=args.enable_cache_events,
            consistent_misses=args.consistent_misses, tier_weight=args.cache_tier_weight, seed=args.seed)
        # one policy per pool of workers: the plain fleet (role None), or PD's prefill and decode pools
        self.policies: dict[str | None, RouterPolicy]
        if args.pd_disaggregation:
            self.policies = {"prefill": make_router_policy(args.prefill_policy or args.policy, config),
                             "decode": make_router_policy(args.decode_policy or args.policy, config)}
        else:
            self.policies = {None: make_router_policy(args.policy, config)}
        self.policy = next(iter(self.policies.values()))
        self.needs_key = any(p.uses_tree for p in self.policies.values())
        self.fleet = Fleet(args, self.policies)
        tenants = TenantCounters(parse_tenant_weights(args.tenant_weights)) if args.tenant_fairness else None
        self.admission = Admission(args.max_concurrent_requests, args.queue_size, args.queue_timeout_secs, tenants)
        self.metrics = RouterMetrics(lambda: list(self.workers.values()), lambda: self.admission.waiting)
        self.tokenizer: Any = None
        self.rng = random.Random(args.seed)
        self.homes = ResponseHomes()  # the worker that stores each Responses API answer
        self.key_headers = [h.strip().lower() for h in (args.routing_key_headers or "").split(",") if h.strip()]
        self.affinity = SessionAffinity(args.session_affinity_ttl_secs, args.balance_abs_threshold,
                                        args.balance_rel_threshold) \
            if self.key_headers or args.routing_key_user else None
        self.rate_limits = RateLimits.from_file(args.tenant_rate_limit_config) \
            if args.tenant_rate_limit_config is not None else None

    @property
    def workers(self) -> dict[str, Worker]:
        return self.fleet.workers

    @property
    def session(self) -> aiohttp.ClientSession | None:
        return self.fleet.session

    # --- life cycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.fleet.start()
        if self.args.prefix_match == "tokens":
            self._load_tokenizer()

    async def stop(self) -> None:
        await self.fleet.stop()

    def _load_tokenizer(self) -> None:
        from radixserve.model.tokenizer import Tokenizer

        path = self.args.tokenizer_path or next((w.model_path for w in self.workers.values() if w.model_path), None)
        self.tokenizer = Tokenizer.from_model_path(path)
        logger.info("matching prefixes by tokens (tokenizer of %s)", path or "the bundled model")

    # --- the request path ------------------------------------------------------------------------
    def route_request(self, path: str, body: dict[str, Any], headers: Any = None) -> RouteRequest:
        """The routing key (and time-to-first-token deadline) of a generate, completion or chat body."""
        rreq = prompt_key(path, body, self.tokenizer)
        raw = (headers or {}).get("x-ttft-slo-ms") or body.get("ttft_slo_ms") or body.get("deadline_ms")
        try:
            ms = float(raw) if raw is not None and not isinstance(raw, bool) else None
        except (TypeError, ValueError):
            ms = None  # the worker says what is wrong with it
        rreq.deadline_ms = ms if ms is not None and ms > 0 else None
        return rreq

    async def proxy(self, request: web.Request, path: str) -> web.StreamResponse:
        raw = await request.read()
        order = self.queue_order(request, raw)
        if self.rate_limits is not None:  # refused at once: over its limit, a tenant takes no queue slot
            label = self.rate_limits.label(order[1])
            wait = self.rate_limits.admit(order[1], order[2], time.monotonic())
            self.metrics.tenant_requests.labels(label, "admitted" if wait is None else "rate_limited").inc()
            if wait is not None:
                self.metrics.rejected.labels("tenant_rate_limit").inc()
                return error_response(f"Rate limit of tenant {label!r} reached (--tenant-rate-limit-config); retry "
                                      f"in {wait} s.", 429, "rate_limit_exceeded", {"Retry-After": str(wait)})
        a = self.args
        if not (a.enable_priority_scheduling or a.tenant_fairness):
            order = (0, "", 0.0)  # first come, first served
        if not await self.admission.acquire(*order):
            self.metrics.rejected.labels("queue_full").inc()
            return error_response("The router is at --max-concurrent-requests and its queue is full; retry "
                                  "later.", 429, "rate_limit_exceeded", {"Retry-After": "1"})
        try:
            return await self._proxy(request, path, raw)
        finally:
            self.admission.release()

    def queue_order(self, request: web.Request, raw: bytes) -> tuple[int, str, float]:
        """(priority rank, tenant, cost in tokens) for the router's queue and its rate limits."""
        a = self.args
        if not (a.enable_priority_scheduling or a.tenant_fairness or self.rate_limits is not None):
            return 0, "", 0.0
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            body = None
        if not isinstance(body, dict):
            return 0, "", 0.0  # the worker will refuse it; no reason to hold it back
        rank = 0
        if a.enable_priority_scheduling:
            p = body.get("priority")
            if isinstance(p, int) and not isinstance(p, bool):
                rank = p if a.schedule_low_priority_values_first else -p
            else:
                rank = NO_PRIORITY_RANK  # as the engine: a request without a priority is the least important
        tenant = request.headers.get("x-tenant") or body.get("user") or body.get("tenant") or ""
        sp = body.get("sampling_params")
        out = body.get("max_tokens") or body.get("max_completion_tokens") or \
            (sp.get("max_new_tokens") if isinstance(sp, dict) else None) or DEFAULT_OUTPUT_TOKENS
        cost = len(raw) / 4 + (out if isinstance(out, int | float) else DEFAULT_OUTPUT_TOKENS)
        return rank, str(tenant), float(cost)

    async def _proxy(self, request: web.Request, path: str, raw: bytes) -> web.StreamResponse:
        t0 = time.perf_counter()
        body: dict[str, Any] | None = None
        if self.args.pd_disaggregation:
            return await proxy_pd(self, request, path, raw, t0)
        if self.needs_key or self.args.dp_aware or self.args.routing_key_user:
            parsed = json_object(raw)
            if isinstance(parsed, web.Response):
                return parsed
            body = parsed
        rreq = self.route_request(path, body, request.headers) if self.needs_key and body is not None \
            else RouteRequest()
        headers = self.upstream_headers(request)
        home = self.homes.home_of_body(raw, body) if path == "/v1/responses" else None
        a = self.args
        session = routing_key(request.headers, body, self.key_headers, a.routing_key_user) \
            if self.affinity is not None else None
        tried: set[str] = set()
        attempt = 0
        while True:
            targets = self.fleet.eligible(tried)
            if not targets:
                self.metrics.rejected.labels("no_worker").inc()
                return error_response("No healthy worker is available.", 503, "no_healthy_worker",
                                      {"Retry-After": "1"})
            at_home = [t for t in targets if t.url == home]
            if at_home:  # a conversation continues where its stored response is
                target = at_home[0]
                self.metrics.decisions.labels(self.policy.name, "previous_response").inc()
            else:
                try:
                    decision = decide(self.policy, self.affinity, targets, rreq, session, time.monotonic())
                except NoTargetMeetsDeadline as e:
                    self.metrics.rejected.labels("deadline").inc()
                    return web.json_response(error_body(str(e), 429, "deadline_unmeetable", "rate_limit_error"),
                                             status=429, headers={"Retry-After": "1"})
                self.metrics.decisions.labels(self.policy.name, decision.branch).inc()
                target = decision.target
            target.sent_tokens += rreq.num_tokens
            worker = self.workers[target.url]
            payload = raw
            if target.dp_rank is not None and body is not None:
                payload = json.dumps({**body, "data_parallel_rank": target.dp_rank}).encode()
            tried.add(worker.url)
            if attempt == 0:
                self.metrics.overhead.observe(time.perf_counter() - t0)
            outcome = await self.send(request, path, worker, target, payload, headers,
                                       last=attempt >= a.retry_max_retries)
            if isinstance(outcome, web.StreamResponse):
                return outcome
            attempt += 1
            self.metrics.retries.labels(outcome).inc()
            await self.backoff(attempt)

    def count_failure(self, worker: Worker, e: BaseException) -> None:
        """A connection error or time-out at ``worker``: against its breaker, and a health check now."""
        worker.breaker.record_failure(time.monotonic())
        asyncio.get_running_loop().create_task(self.fleet.check_worker(worker, after_error=e))
        logger.warning("worker %s: %s: %s", worker.url, type(e).__name__, e)

    def upstream_headers(self, request: web.Request) -> dict[str, str]:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP_REQ}
        headers.update(self.fleet.auth)
        headers.setdefault("Content-Type", "application/json")
        return headers

    async def backoff(self, attempt: int) -> None:
        a = self.args
        delay = min(a.retry_initial_backoff_ms * a.retry_backoff_multiplier ** (attempt - 1), a.retry_max_backoff_ms)
        delay *= 1.0 + a.retry_jitter_factor * (2.0 * self.rng.random() - 1.0)
        await asyncio.sleep(max(delay, 0.0) / 1e3)

    async def send(self, request: web.Request, path: str, worker: Worker, target: Target, payload: bytes,
                    headers: dict[str, str], last: bool) -> web.StreamResponse | str:
        """Send once. Returns the client's response, or the reason to retry (only when ``last`` is
        False and nothing was sent to the client)."""
        assert self.session is not None
        target.load += 1
        worker.breaker.on_send()
        self.metrics.requests.labels(worker.url, path).inc()
        try:
            try:
                upstream = await self.session.post(worker.url + path, data=payload, headers=headers)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                return self.worker_failed(worker, e, last)
            async with upstream:
                status = upstream.status
                if status >= 500 or status == 429:
                    if status >= 500:
                        worker.breaker.record_failure(time.monotonic())
                    else:
                        worker.breaker.probing = False
                    if not last:
                        await upstream.read()
                        return "status_429" if status == 429 else "status_5xx"
                else:
                    worker.breaker.record_success()
                    self.homes.record(upstream.headers.get(RESPONSE_ID_HEADER), worker.url)
                if self.fleet.lifecycle is not None:
                    self.fleet.lifecycle.contact(worker.url, time.monotonic())
                headers = {k: upstream.headers[k] for k in _KEEP_RESP if k in upstream.headers}
                if upstream.headers.get("Content-Type", "").startswith("text/event-stream"):
                    self.metrics.responses.labels(str(status)).inc()
                    return await self._relay_stream(request, upstream, worker, headers)
                try:
                    body = await upstream.read()
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:  # died while sending its answer
                    return self.worker_failed(worker, e, last)
                self.metrics.responses.labels(str(status)).inc()
                return web.Response(body=body, status=status, headers=headers)
        finally:
            target.load -= 1

    def worker_failed(self, worker: Worker, e: BaseException, last: bool) -> web.Response | str:
        """A connection error or time-out at ``worker`` before the client was sent anything: count
        it against the worker, check its health now, and retry elsewhere (or answer 502 if ``last``)."""
        self.count_failure(worker, e)
        if not last:
            return "connection_error"
        return error_response(f"worker {worker.url} failed: {type(e).__name__}", 502, "bad_gateway")

    async def _relay_stream(self, request: web.Request, upstream: aiohttp.ClientResponse, worker: Worker,
                            headers: dict[str, str]) -> web.StreamResponse:
        """Pass the worker's SSE events on as they come, whole events only (a chunk can end inside
        one). If the worker fails mid-stream, the client gets an error event in OpenAI's shape and
        ``[DONE]`` in place of the event that was cut, so it never hangs or parses half an event."""
        resp = web.StreamResponse(status=upstream.status, headers=headers)
        request[STREAMED] = True  # from here on a failure cannot be retried: the client has bytes
        await resp.prepare(request)
        pending = b""
        chunks = upstream.content.iter_any()
        while True:
            try:
                chunk = await chunks.__anext__()
            except StopAsyncIteration:
                break
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                self.count_failure(worker, e)
                self.metrics.stream_failures.inc()
                err = error_body(f"the worker serving this stream failed ({type(e).__name__}); the output "
                                 "above is incomplete", 502, "worker_failed")
                await resp.write(b"data: " + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n")
                pending = b""
                break
            pending += chunk
            cut = pending.rfind(b"\n\n") + 2
            if cut >= 2:
                await resp.write(pending[:cut])
                pending = pending[cut:]
        if pending:
            await resp.write(pending)
        await resp.write_eof()
        return resp

    # --- fan-out endpoints -----------------------------------------------------------------------
    async def forward_one(self, request: web.Request, path: str) -> web.Response:
        """A call any worker can answer (models, info, tokenize): the first eligible one."""
        assert self.session is not None
        data = await request.read() if request.method == "POST" else None
        headers = {**self.fleet.auth, "Content-Type": "application/json"} if data is not None else self.fleet.auth
        for t in [t for role in self.policies for t in self.fleet.eligible(role=role)]:
            w = self.workers[t.url]
            try:
                async with self.session.request(request.method, w.url + path, headers=headers,
                                                params=request.query, data=data) as r:
                    body = await r.read()
                    return web.Response(body=body, status=r.status,
                                        headers={k: r.headers[k] for k in _KEEP_RESP if k in r.headers})
            except (aiohttp.ClientError, asyncio.TimeoutError):
                continue
        return error_response("No healthy worker is available.", 503, "no_healthy_worker")

    async def fan_out(self, method: str, path: str, body: bytes | None = None,
                      admin: bool = False) -> dict[str, tuple[int, Any]]:
        """Call every worker; {url: (status or 0 when unreachable, JSON body or error text)}.
        ``admin``: an admin call, sent with the workers' admin key."""
        assert self.session is not None
        headers = {**(self.fleet.admin_auth if admin else self.fleet.auth), "Content-Type": "application/json"}

        async def one(w: Worker) -> tuple[str, tuple[int, Any]]:
            try:
                async with self.session.request(method, w.url + path, headers=headers,  # type: ignore[union-attr]
                                                data=body) as r:
                    try:
                        return w.url, (r.status, await r.json(content_type=None))
                    except ValueError:
                        return w.url, (r.status, await r.text())
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                return w.url, (0, f"{type(e).__name__}: {e}")

        return dict(await asyncio.gather(*(one(w) for w in list(self.workers.values()))))


def routed_paths() -> Sequence[str]:
    return ("/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses")
