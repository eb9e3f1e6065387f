"""``Fleet``: the workers behind the router, and what keeps the router's view of them true.

- Discovery: a worker's ``/get_server_info`` gives its ``dp_size`` (one target per rank with
  ``--dp-aware``), model path (for ``--prefix-match tokens``), cache-event endpoint and, for a PD
  prefill worker, its bootstrap port. A worker not reachable at start stays out of rotation until
  its health checks pass, and is read again then.
- Lifecycle (lifecycle.py): stalled and wedged workers get no new traffic, a joining one warms up.
- Workers from ``--discovery-file`` (discovery.py) or Kubernetes pods (kube_discovery.py) join and
  leave while the router runs.
- Health: every ``--health-check-interval-secs`` each worker's ``/health`` (``worker.Health``); a
  connection error on the request path checks at once (``check_worker``), and if that check finds
  nothing listening (connection refused: the process is gone) the worker leaves rotation at once. A worker back from the
  dead gets a closed breaker, a fresh read of its info and an empty part of the prefix tree.
- Loads: with ``power_of_two`` and ``deadline_aware``, each worker's ``/get_load`` every
  ``LOAD_REFRESH_S``.
- The prefix trees are evicted down to ``--max-tree-size`` every ``--eviction-interval-secs``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import aiohttp

from radixserve.router.config import RouterArgs
from radixserve.router.lifecycle import Lifecycle
from radixserve.router.policy import RouterPolicy, Target
from radixserve.router.worker import CircuitBreaker, Health, Worker

logger = logging.getLogger("radixserve.router")
LOAD_REFRESH_S = 1.0  # power_of_two, deadline_aware: how often the workers' /get_load is read


class Fleet:
    def __init__(self, args: RouterArgs, policies: dict[str | None, RouterPolicy]) -> None:
        self.args = args
        self.policies = policies
        self.workers: dict[str, Worker] = {}
        self.session: aiohttp.ClientSession | None = None
        self.subscribers: dict[str, Any] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self.discovery: Any = None  # FileDiscovery or KubernetesDiscovery
        self.running = False  # start() is done: workers added from now on join a running fleet
        self.lifecycle = Lifecycle(args.worker_stall_secs, args.worker_wedge_secs, args.worker_warmup_secs, args.seed) \
            if args.worker_stall_secs is not None or args.worker_wedge_secs is not None or args.worker_warmup_secs > 0 \
            else None
        self._checking: set[str] = set()
        key = args.worker_api_key or args.api_key
        self.auth = {"Authorization": f"Bearer {key}"} if key else {}
        admin = args.worker_admin_api_key or args.admin_api_key
        self.admin_auth = {"Authorization": f"Bearer {admin}"} if admin else self.auth  # the admin calls passed on

    async def start(self) -> None:
        """Open the keep-alive pool, add the configured workers (waiting for them up to
        --worker-startup-timeout-secs) and start the health, load and eviction loops."""
        a = self.args
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0, enable_cleanup_closed=True),
            timeout=aiohttp.ClientTimeout(total=a.request_timeout_secs, sock_connect=5.0),
            auto_decompress=False, skip_auto_headers=("User-Agent",))
        ports = a.prefill_bootstrap_ports or (0,) * len(a.prefill_urls)
        await asyncio.gather(*(self.add_worker(u, wait=True) for u in a.worker_urls),
                             *(self.add_worker(u, wait=True, role="prefill", bootstrap_port=port or None)
                               for u, port in zip(a.prefill_urls, ports, strict=True)),
                             *(self.add_worker(u, wait=True, role="decode") for u in a.decode_urls))
        from radixserve.router.discovery import provider

        if a.discovery_file is not None:  # the file provider, named or not (config refuses file + kubernetes)
            from radixserve.router.discovery import FileDiscovery

            self.discovery = FileDiscovery(a.discovery_file, self, a.discovery_interval_secs)
        elif provider(a) == "kubernetes":
            from radixserve.router.kube_discovery import KubernetesDiscovery

            self.discovery = KubernetesDiscovery(self, a.discovery_selector, a.discovery_namespace,
                                                 a.discovery_port, a.discovery_interval_secs)
        if self.discovery is not None:
            try:
                await self.discovery.sync()  # the workers it lists are in before the first request
            except Exception:  # the router does not start: leave nothing open behind it
                await self.stop()
                raise
            self._tasks.append(asyncio.create_task(self.discovery.run(), name="discovery"))
        self.running = True
        self._tasks.append(asyncio.create_task(self._health_loop(), name="health"))
        if any(p.uses_tree for p in self.policies.values()):
            self._tasks.append(asyncio.create_task(self._eviction_loop(), name="evict"))
        if a.policy in ("power_of_two", "deadline_aware") or (self.lifecycle and self.lifecycle.watches_steps):
            self._tasks.append(asyncio.create_task(self._load_loop(), name="loads"))

    async def stop(self) -> None:
        if self.discovery is not None:
            self.discovery.stop()
        for t in self._tasks:
            t.cancel()
        for sub in self.subscribers.values():
            await sub.stop()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.session is not None:
            await self.session.close()

    def policy_for(self, w: Worker) -> RouterPolicy:
        return self.policies[w.role]

    async def add_worker(self, url: str, wait: bool = False, role: str | None = None,
                         bootstrap_port: int | None = None) -> Worker:
        url = url.rstrip("/")
        a = self.args
        if role not in self.policies:
            raise ValueError(f"worker role {role!r}: this router takes "
                             f"{' and '.join(str(r) for r in self.policies) if a.pd_disaggregation else 'no role'}")
        w = Worker(url, Health(a.health_failure_threshold, a.health_success_threshold),
                   CircuitBreaker(a.cb_failure_threshold, a.cb_success_threshold, a.cb_timeout_duration_secs),
                   role=role, bootstrap_port=bootstrap_port)
        deadline = time.monotonic() + (a.worker_startup_timeout_secs if wait else 0.0)
        while True:
            info = await self._server_info(url)
            if info is not None or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.5)
        if info is None:
            logger.warning("worker %s is not reachable; it gets traffic once its health checks pass", url)
            w.health.healthy = False
        else:
            self._apply_info(w, info)
        w.make_targets(a.dp_aware)
        self.workers[url] = w
        if self.lifecycle is not None and self.running:  # one that joins later warms up
            self.lifecycle.joined(url, time.monotonic())
        self._subscribe(w)
        logger.info("worker %s added (%d target(s))", url, len(w.targets))
        return w

    async def remove_worker(self, url: str) -> bool:
        w = self.workers.pop(url.rstrip("/"), None)
        if w is None:
            return False
        if self.lifecycle is not None:
            self.lifecycle.left(w.url)
        for t in w.targets:
            self.policy_for(w).remove_target(t.key)
        sub = self.subscribers.pop(w.url, None)
        if sub is not None:
            await sub.stop()
        logger.info("worker %s removed", w.url)
        return True

    def _apply_info(self, w: Worker, info: dict[str, Any]) -> None:
        w.dp_size = int(info.get("dp_size") or 1)
        w.model_path = info.get("model_path")
        w.cache_events_endpoint = info.get("cache_events_endpoint")
        w.kv_events_endpoint = info.get("kv_events_endpoint")
        if w.role == "prefill" and w.bootstrap_port is None and info.get("disaggregation_bootstrap_port"):
            w.bootstrap_port = int(info["disaggregation_bootstrap_port"])
        mode = info.get("disaggregation_mode")
        if w.role is not None and mode not in (None, w.role):
            logger.warning("worker %s runs --disaggregation-mode %s but is listed as a %s worker", w.url, mode, w.role)

    def _subscribe(self, w: Worker) -> None:
        if not self.args.enable_cache_events or w.url in self.subscribers:
            return
        from radixserve.router.cache_events import CacheEventSubscriber
        from radixserve.router.vllm_event_reader import VLLMEventSubscriber

        vllm = self.args.cache_events_format == "vllm"
        endpoint = w.kv_events_endpoint if vllm else w.cache_events_endpoint
        if not endpoint:
            logger.warning("worker %s publishes no %s (start it with %s); its tree stays approximate", w.url,
                           "KV events" if vllm else "cache events", "--kv-events-config" if vllm else
                           "--cache-events-port")
            return
        # NOTE: one subscriber per worker feeds the worker's first target; with --dp-aware each rank
        # has its own cache, and events name no rank yet, so only rank 0 follows real state.
        kind = VLLMEventSubscriber if vllm else CacheEventSubscriber
        sub = kind(endpoint, w.targets[0].key, self.policy_for(w))
        sub.start()
        self.subscribers[w.url] = sub

    async def _server_info(self, url: str) -> dict[str, Any] | None:
        assert self.session is not None
        try:
            async with self.session.get(f"{url}/get_server_info", headers=self.auth,
                                        timeout=aiohttp.ClientTimeout(total=self.args.health_check_timeout_secs)) as r:
                if r.status != 200:
                    return None
                data = await r.json(content_type=None)
                return data if isinstance(data, dict) else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return None

    def eligible(self, exclude: set[str] | None = None, role: str | None = None) -> list[Target]:
        now = time.monotonic()
        workers = [w for w in self.workers.values()
                   if w.role == role and (not exclude or w.url not in exclude) and w.eligible(now)]
        if self.lifecycle is not None:  # stalled, wedged, warming up (lifecycle.py); never all of them
            live = [w for w in workers if self.lifecycle.admits(w.url, w.load, now)]
            workers = live or workers
        out = [t for w in workers for t in w.targets]
        if not out and exclude:  # every worker was tried: any eligible one may be tried again
            return self.eligible(role=role)
        return out

    def serving(self) -> bool:
        """Can a request be served now: an eligible target in every pool."""
        return all(self.eligible(role=role) for role in self.policies)

    # --- health ----------------------------------------------------------------------------------
    async def _health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self.check_worker(w) for w in list(self.workers.values())))
            await asyncio.sleep(self.args.health_check_interval_secs)

    async def check_worker(self, w: Worker, after_error: BaseException | None = None) -> None:
        """One health check of ``w``. ``after_error``: a request to it just failed; if nothing even
        listens on its port now (connection refused), the process is gone: it leaves rotation at
        once instead of after --health-failure-threshold checks."""
        if w.url in self._checking:
            return
        self._checking.add(w.url)
        try:
            ok, refused = await self._probe(w)
            if after_error is not None and refused and w.health.healthy:
                w.health.eject()
                logger.warning("worker %s is gone (%s, then connection refused): no traffic", w.url,
                               type(after_error).__name__)
            elif w.health.record(ok):
                logger.warning("worker %s is %s", w.url, "healthy again" if ok else "unhealthy: no traffic")
                if ok:  # back from the dead: a fresh process, so its old failures say nothing now
                    w.breaker.reset()
                    if self.lifecycle is not None:
                        self.lifecycle.joined(w.url, time.monotonic())  # it warms up again
                    # and its cache is empty: drop its prefix-tree state now, before anything awaits
                    # (it takes traffic from this moment; stale state would steer requests away)
                    for t in w.targets:
                        self.policy_for(w).remove_target(t.key)
                    await self._rediscover(w)
            if ok and self.lifecycle is not None:
                self.lifecycle.contact(w.url, time.monotonic())
        finally:
            self._checking.discard(w.url)

    async def _probe(self, w: Worker) -> tuple[bool, bool]:
        """(passed, refused): refused when nothing listens on the worker's port."""
        assert self.session is not None
        try:
            async with self.session.get(w.url + self.args.health_check_endpoint, headers=self.auth,
                                        timeout=aiohttp.ClientTimeout(total=self.args.health_check_timeout_secs)) as r:
                await r.read()
                return r.status == 200, False
        except aiohttp.ClientConnectorError as e:
            return False, isinstance(e.os_error, ConnectionRefusedError)
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False, False

    async def _rediscover(self, w: Worker) -> None:
        """A worker came back (maybe restarted, maybe with another dp_size): read its info again."""
        info = await self._server_info(w.url)
        if info is None:
            return
        old = w.dp_size
        self._apply_info(w, info)
        if w.dp_size != old:  # other targets now: the old ones' tree state goes with them
            for t in w.targets:
                self.policy_for(w).remove_target(t.key)
            w.make_targets(self.args.dp_aware)
        sub = self.subscribers.pop(w.url, None)
        if sub is not None:
            await sub.stop()
        self._subscribe(w)

    async def _load_loop(self) -> None:
        """power_of_two compares loads; the workers' own counts also see traffic that bypasses us."""
        while True:
            now = time.monotonic()  # (a wedged worker is read too: its steps moving again bring it back)
            await asyncio.gather(*(self._refresh_loads(w) for w in list(self.workers.values()) if w.eligible(now)))
            await asyncio.sleep(LOAD_REFRESH_S)

    async def _refresh_loads(self, w: Worker) -> None:
        assert self.session is not None
        try:
            async with self.session.get(f"{w.url}/get_load", headers=self.auth,
                                        timeout=aiohttp.ClientTimeout(total=self.args.health_check_timeout_secs)) as r:
                loads = await r.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return
        if not isinstance(loads, list):
            return
        by_rank = {int(x.get("dp_rank", i)): x for i, x in enumerate(loads) if isinstance(x, dict)}
        if self.lifecycle is not None:
            self.lifecycle.steps(w.url, sum(int(x.get("forward_steps", 0)) for x in by_rank.values()),
                                 time.monotonic())
        for t in w.targets:
            mine = [by_rank.get(t.dp_rank, {})] if t.dp_rank is not None else list(by_rank.values())
            t.reported_load = sum(int(x.get("num_reqs", 0)) for x in mine)
            t.waiting_tokens = sum(int(x.get("num_waiting_tokens", 0)) for x in mine)
            speeds = [float(x.get("prefill_tokens_per_s", 0.0)) for x in mine]
            t.prefill_tokens_per_s = sum(speeds)  # ranks of one target prefill side by side
            t.sent_tokens = 0  # the report includes what was sent before it

    async def _eviction_loop(self) -> None:
        while True:
            await asyncio.sleep(self.args.eviction_interval_secs)
            dropped = sum(p.evict() for p in self.policies.values())
            if dropped:
                logger.debug("prefix tree: evicted %d elements", dropped)


    def describe(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return [{"url": w.url, "role": w.role, "bootstrap_port": w.bootstrap_port,
                 "healthy": w.health.healthy, "eligible": w.eligible(now),
                 "circuit_breaker": w.breaker.state.value, "dp_size": w.dp_size, "load": w.load,
                 "targets": [{"key": t.key, "dp_rank": t.dp_rank, "load": t.load,
                              "reported_load": t.reported_load} for t in w.targets],
                 "cache_events": w.url in self.subscribers} for w in self.workers.values()]
