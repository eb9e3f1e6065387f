"""``RouterArgs``: every ``radixserve router`` option, with sgl-router's flag names and defaults.

The CLI is generated from the fields (``--`` + field name with ``-``), as for ``ServerArgs``.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

from radixserve.options import add_dataclass_cli_args, dataclass_from_cli_args, option, parse_tenant_weights
from radixserve.router.discovery import provider

ROUTER_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two", "deadline_aware")


@dataclass(frozen=True)
class RouterArgs:
    # --- fleet -----------------------------------------------------------------------------------
    worker_urls: tuple[str, ...] = option(
        (), "Base URLs of the workers (radixserve serve, or any SGLang-compatible server).", group="fleet")
    dp_aware: bool = option(
        False, "Read each worker's dp_size from /get_server_info and route to one of its data-parallel "
        "ranks, sent as data_parallel_rank.", group="fleet")
    worker_api_key: str | None = option(
        None, "Bearer key the router sends to the workers (default: --api-key).", group="fleet")
    worker_admin_api_key: str | None = option(
        None, "Bearer key the router sends with the admin calls it passes on to the workers (/flush_cache, "
        "/abort_request, /set_schedule_policy), for workers started with --admin-api-key (default: "
        "--admin-api-key, else the --worker-api-key).", group="fleet")
    pd_disaggregation: bool = option(
        False, "Prefill/decode disaggregation: every request goes to a --prefill worker and a --decode "
        "worker at once, with a bootstrap_room naming the KV hand-over; the client gets the decode "
        "worker's answer.", group="fleet")
    prefill_urls: tuple[str, ...] = option((), "PD: the prefill workers (--prefill URL [BOOTSTRAP_PORT]).",
                                           group="fleet")
    prefill_bootstrap_ports: tuple[int, ...] = option(
        (), "PD: each prefill worker's bootstrap port (0: read it from its /get_server_info).", group="fleet")
    decode_urls: tuple[str, ...] = option((), "PD: the decode workers (--decode URL).", group="fleet")
    discovery_file: str | None = option(
        None, "A JSON or YAML file listing workers (URLs, or {url, role, bootstrap_port} objects), watched: "
        "workers it adds or drops join or leave the fleet live (docs/router.md).", group="fleet")
    discovery_provider: str | None = option(
        None, "Where workers are found besides the command line: 'file' (--discovery-file) or 'kubernetes' "
        "(pods matching --discovery-selector, through the Kubernetes API; docs/fleet-operations.md). "
        "Default: file when --discovery-file is given.", ("file", "kubernetes"), group="fleet")
    discovery_interval_secs: float = option(
        5.0, "Discovery: seconds between looks at the --discovery-file; with kubernetes, how long one watch "
        "of the pods runs before they are listed again (and the wait after an API error).", group="fleet")
    discovery_selector: str = option(
        "app=radixserve-worker", "Kubernetes discovery: the label selector of the worker pods.", group="fleet")
    discovery_namespace: str | None = option(
        None, "Kubernetes discovery: the namespace of the worker pods (default: the router pod's own, "
        "else 'default').", group="fleet")
    discovery_port: int = option(
        30000, "Kubernetes discovery: the workers' HTTP port, for pods without a radixserve.io/port "
        "annotation.", group="fleet")
    prefill_policy: str | None = option(None, "PD: how a prefill worker is picked (default: --policy).",
                                        ROUTER_POLICIES, group="fleet")
    decode_policy: str | None = option(None, "PD: how a decode worker is picked (default: --policy).",
                                       ROUTER_POLICIES, group="fleet")
    worker_startup_timeout_secs: float = option(
        600.0, "How long to wait for the workers to come up at start; a worker still down after it is "
        "kept out of rotation until its health checks pass.", group="fleet")

    # --- policy ----------------------------------------------------------------------------------
    policy: str = option("cache_aware", "How a worker is picked for each request (docs/router.md).",
                         ROUTER_POLICIES, group="policy")
    cache_threshold: float = option(
        0.3, "cache_aware: a match rate above this routes to the worker holding the prefix.", group="policy")
    balance_abs_threshold: int = option(
        64, "cache_aware: imbalanced when max_load - min_load exceeds this (and the relative threshold).",
        group="policy")
    balance_rel_threshold: float = option(
        1.5, "cache_aware: imbalanced when max_load > min_load * this (and the absolute threshold).",
        group="policy")
    eviction_interval_secs: float = option(
        60.0, "cache_aware: how often the prefix tree is evicted down to --max-tree-size per worker.",
        group="policy")
    max_tree_size: int = option(
        2**26, "cache_aware: most elements (characters, or tokens with --prefix-match tokens) the tree "
        "keeps per worker.", group="policy")
    balance_affinity: bool = option(
        False, "cache_aware: when imbalanced, pick the best prefix match among the workers within the "
        "balance window of the least loaded one instead of the least loaded alone.", group="policy")
    consistent_misses: bool = option(
        False, "cache_aware: a request whose prompt no worker holds enough of goes to the worker a hash of "
        "the prompt ranks first among those within the balance window (instead of the least loaded), so "
        "router replicas, whose in-flight counts differ, route alike (docs/router.md).",
        group="policy")
    prefix_match: str = option(
        "chars", "cache_aware: match characters of the prompt (sgl-router) or tokens (the router "
        "tokenizes with the model's tokenizer, so the match rate is the real cache hit rate).",
        ("chars", "tokens"), group="policy")
    tokenizer_path: str | None = option(
        None, "--prefix-match tokens: the model whose tokenizer to use (default: the first worker's "
        "model_path, read from /get_server_info).", group="policy")
    enable_cache_events: bool = option(
        False, "cache_aware: subscribe to the workers' cache events (workers started with "
        "--cache-events-port) so the tree forgets prefixes the workers evicted.", group="policy")
    cache_tier_weight: float = option(
        0.5, "cache_aware with --enable-cache-events: credit for a prefix a worker holds in its KV tier "
        "(--enable-hierarchical-cache: loaded, not computed) relative to one in its KV pool: the match "
        "past the pool counts this much (0: the tier is ignored, 1: as good as the pool).", group="policy")
    cache_events_format: str = option(
        "radixserve", "--enable-cache-events: the events to follow: radixserve's own (workers started with "
        "--cache-events-port) or vLLM's published KV-event schema (workers started with --kv-events-config; "
        "the endpoint is read from /get_server_info's kv_events_endpoint).", ("radixserve", "vllm"),
        group="policy")
    routing_key_headers: str | None = option(
        None, "Session affinity: headers whose value is a request's routing key, first present wins (comma-"
        "separated, e.g. x-session-id); a key's requests stay on one target (docs/router.md).", group="policy")
    routing_key_user: bool = option(
        False, "Session affinity: the OpenAI user field is the routing key of a request without a "
        "--routing-key-headers header.", group="policy")
    session_affinity_ttl_secs: float = option(
        1800.0, "Session affinity: a key's target is forgotten after this many seconds without a request.",
        group="policy")
    seed: int | None = option(None, "Seed of the random and power_of_two policies.", group="policy")

    # --- quality of service across the fleet -------------------------------------------------------
    enable_priority_scheduling: bool = option(
        False, "Requests waiting at the router (past --max-concurrent-requests) are let through by their "
        "priority field first (larger is more important, as the engine's), then in order of arrival.",
        group="qos")
    schedule_low_priority_values_first: bool = option(
        False, "With --enable-priority-scheduling: a smaller priority value is more important.", group="qos")
    tenant_fairness: bool = option(
        False, "Requests waiting at the router are let through by virtual token counters per tenant "
        "(VTC: x-tenant header, else the OpenAI user / native tenant field), fleet-wide; after priority.",
        group="qos")
    tenant_weights: str | None = option(
        None, "--tenant-fairness: relative shares, e.g. 'a=2,b=1' (default 1 each).", group="qos")
    tenant_rate_limit_config: str | None = option(
        None, "A JSON file of per-tenant token buckets: {\"default\": {...}, \"tenants\": {\"name\": {...}}} with "
        "requests_per_second, request_burst, tokens_per_second, token_burst (docs/router.md); a request over "
        "its tenant's limit gets 429 with Retry-After at once.", group="qos")

    # --- reliability -----------------------------------------------------------------------------
    worker_stall_secs: float | None = option(
        None, "A worker with no contact (health check, load read, answer) for this many seconds gets no new "
        "traffic until contact resumes (default: off; health checks alone).", group="reliability")
    worker_wedge_secs: float | None = option(
        None, "A worker with requests of ours in flight whose engine ran no step (/get_load forward_steps, "
        "read every second) for this many seconds gets no new traffic; its requests are left to finish; "
        "back when its steps move (default: off).", group="reliability")
    worker_warmup_secs: float = option(
        0.0, "A worker that joins or comes back gets a share growing from 0 to full over this many seconds "
        "(0: full at once).", group="reliability")
    health_check_interval_secs: float = option(60.0, "Seconds between health checks of each worker.",
                                               group="reliability")
    health_check_timeout_secs: float = option(5.0, "Timeout of one health check.", group="reliability")
    health_check_endpoint: str = option("/health", "Path the health check GETs.", group="reliability")
    health_failure_threshold: int = option(
        3, "Consecutive failed checks after which a worker gets no traffic.", group="reliability")
    health_success_threshold: int = option(
        2, "Consecutive passed checks after which an unhealthy worker is back.", group="reliability")
    retry_max_retries: int = option(
        5, "Retries of a request on another worker after a connection error, 5xx or 429 (never once "
        "streaming to the client has started).", group="reliability")
    retry_initial_backoff_ms: int = option(50, "First retry delay.", group="reliability")
    retry_max_backoff_ms: int = option(30000, "Longest retry delay.", group="reliability")
    retry_backoff_multiplier: float = option(2.0, "Delay growth per retry.", group="reliability")
    retry_jitter_factor: float = option(0.1, "Random +- fraction added to each delay.", group="reliability")
    cb_failure_threshold: int = option(
        10, "Consecutive failed requests that open a worker's circuit breaker; 0 disables it.",
        group="reliability")
    cb_success_threshold: int = option(3, "Successful probes that close a half-open breaker.",
                                       group="reliability")
    cb_timeout_duration_secs: float = option(60.0, "How long an open breaker stays open before a probe.",
                                             group="reliability")

    # --- admission -------------------------------------------------------------------------------
    max_concurrent_requests: int = option(
        256, "Requests in flight through the router at once; -1 for no limit.", group="admission")
    queue_size: int = option(
        100, "Requests that may wait for a slot once --max-concurrent-requests are in flight; past it 429.",
        group="admission")
    queue_timeout_secs: float = option(60.0, "Longest wait in that queue before a 429.", group="admission")
    request_timeout_secs: float = option(1800.0, "Longest a request may take at a worker.", group="admission")

    # --- server ----------------------------------------------------------------------------------
    host: str = option("127.0.0.1", "HTTP host to bind.", group="server")
    port: int = option(30000, "HTTP port to bind.", group="server")
    api_key: str | None = option(
        None, "Require 'Authorization: Bearer <key>' on every endpoint but /health.", group="server")
    admin_api_key: str | None = option(
        None, "Require this key (not --api-key) on the admin endpoints: /flush_cache, /abort_request, "
        "/set_schedule_policy and the worker management (POST/DELETE /workers, /add_worker, /remove_worker). "
        "It opens every other endpoint too. Default: they take --api-key like the rest.", group="server")
    log_level: str = option("info", "Log level.", ("debug", "info", "warning", "error"), group="server")

    def __post_init__(self) -> None:
        errors: list[str] = []
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) is not None and getattr(self, f.name) not in choices:
                errors.append(f"{f.name} must be one of {', '.join(choices)}; got {getattr(self, f.name)!r}")
        if self.pd_disaggregation:
            if (not self.prefill_urls or not self.decode_urls) and provider(self) is None:
                errors.append("--pd-disaggregation needs at least one --prefill and one --decode worker "
                              "(or a --discovery-file or --discovery-provider)")
            if self.worker_urls:
                errors.append("--pd-disaggregation takes --prefill and --decode workers, not --worker-urls")
            if len(self.prefill_bootstrap_ports) not in (0, len(self.prefill_urls)):
                errors.append("one bootstrap port per --prefill worker (0: ask the worker)")
        elif self.prefill_urls or self.decode_urls:
            errors.append("--prefill and --decode workers need --pd-disaggregation")
        for url in (*self.worker_urls, *self.prefill_urls, *self.decode_urls):
            if not url.startswith(("http://", "https://")):
                errors.append(f"worker URL {url!r} must start with http:// or https://")
        if not 0.0 <= self.cache_threshold <= 1.0:
            errors.append("cache_threshold must be in [0, 1]")
        if not 0.0 <= self.cache_tier_weight <= 1.0:
            errors.append("cache_tier_weight must be in [0, 1]")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            errors.append("balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1")
        for name in ("max_tree_size", "health_failure_threshold", "health_success_threshold",
                     "cb_success_threshold", "queue_size"):
            if getattr(self, name) < (0 if name == "queue_size" else 1):
                errors.append(f"{name} must be positive")
        for name in ("eviction_interval_secs", "health_check_interval_secs", "health_check_timeout_secs",
                     "cb_timeout_duration_secs", "queue_timeout_secs", "request_timeout_secs",
                     "worker_startup_timeout_secs"):
            if not getattr(self, name) > 0:
                errors.append(f"{name} must be > 0 seconds")
        if self.retry_max_retries < 0 or self.retry_initial_backoff_ms < 0 or self.cb_failure_threshold < 0:
            errors.append("retry_max_retries, retry_initial_backoff_ms and cb_failure_threshold must be >= 0")
        if self.max_concurrent_requests == 0 or self.max_concurrent_requests < -1:
            errors.append("max_concurrent_requests must be positive or -1 (no limit)")
        if not 0 <= self.port <= 65535:
            errors.append(f"port must be in [0, 65535], got {self.port}")
        if self.tenant_weights is not None:
            try:
                parse_tenant_weights(self.tenant_weights)
            except ValueError as e:
                errors.append(str(e))
        for name in ("worker_stall_secs", "worker_wedge_secs"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                errors.append(f"{name} must be > 0, got {v}")
        if not self.worker_warmup_secs >= 0:
            errors.append(f"worker_warmup_secs must be >= 0, got {self.worker_warmup_secs}")
        if self.discovery_provider == "file" and self.discovery_file is None:
            errors.append("--discovery-provider file needs a --discovery-file")
        if self.discovery_provider == "kubernetes" and self.discovery_file is not None:
            errors.append("--discovery-file and --discovery-provider kubernetes: choose one")
        if not 0 < self.discovery_port < 65536:
            errors.append(f"discovery_port must be a port number, got {self.discovery_port}")
        if not self.discovery_interval_secs > 0:
            errors.append(f"discovery_interval_secs must be > 0, got {self.discovery_interval_secs}")
        if not self.session_affinity_ttl_secs > 0:
            errors.append(f"session_affinity_ttl_secs must be > 0, got {self.session_affinity_ttl_secs}")
        if self.tenant_rate_limit_config is not None:
            from radixserve.router.rate_limits import RateLimits

            try:
                RateLimits.from_file(self.tenant_rate_limit_config)
            except ValueError as e:
                errors.append(str(e))
        if self.enable_cache_events and self.policy not in ("cache_aware", "deadline_aware"):
            errors.append("--enable-cache-events feeds the prefix tree of --policy cache_aware or deadline_aware")
        if self.enable_cache_events and self.prefix_match != "tokens":
            errors.append("--enable-cache-events: the workers' events carry token ids; add --prefix-match tokens")
        if errors:
            raise ValueError("invalid router arguments: " + "; ".join(errors))

    def replace(self, **changes: Any) -> RouterArgs:
        return dataclasses.replace(self, **changes)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
        add_dataclass_cli_args(cls, parser, (*skip, *_PD_FIELDS))
        if "worker_urls" in skip:  # radixserve launch: its own workers, no PD
            return
        pd = parser.add_argument_group("prefill/decode disaggregation")
        pd.add_argument("--prefill", action="append", nargs="+", metavar=("URL", "BOOTSTRAP_PORT"),
                        help="A prefill worker and, optionally, its bootstrap port (repeat for more).")
        pd.add_argument("--decode", action="append", metavar="URL", help="A decode worker (repeat for more).")

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> RouterArgs:
        prefill = getattr(ns, "prefill", None) or []
        for entry in prefill:
            if len(entry) > 2 or (len(entry) == 2 and not entry[1].isdigit()):
                raise ValueError(f"--prefill takes URL [BOOTSTRAP_PORT], got {' '.join(entry)}")
        if prefill:
            ns.prefill_urls = [e[0] for e in prefill]
            ns.prefill_bootstrap_ports = [int(e[1]) if len(e) == 2 else 0 for e in prefill]
        if getattr(ns, "decode", None):
            ns.decode_urls = ns.decode
        return dataclass_from_cli_args(cls, ns)


_PD_FIELDS = ("prefill_urls", "prefill_bootstrap_ports", "decode_urls")
