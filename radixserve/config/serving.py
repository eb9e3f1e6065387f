"""The serving area of ``ServerArgs``: the HTTP server, logging, and the processes behind it (data
and tensor parallelism, several nodes, the cache-event publisher). Flag names follow SGLang's."""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.config.kv_events import KVEventsConfig
from radixserve.options import not_positive, option

# set by ``radixserve launch`` for its workers: the socket of the zygote that forks their schedulers
# (server/zygote.py)
SCHEDULER_ZYGOTE_ENV = "RADIXSERVE_SCHEDULER_ZYGOTE"


@dataclass(frozen=True)
class ServingOptions:
    # Flag names follow SGLang's (--host, --port, --api-key, --enable-metrics, ...).
    host: str = option("127.0.0.1", "HTTP host to bind.", group="server")
    port: int = option(30000, "HTTP port to bind.", group="server")
    shutdown_grace_period_secs: float = option(
        30.0, "On SIGTERM / Ctrl-C: stop admitting (/health answers 503 draining, new requests 503), let the "
        "requests in flight finish for up to this many seconds, then exit 0; a second signal exits at once. "
        "0: exit at once.", group="server")
    api_key: str | None = option(
        None, "Require 'Authorization: Bearer <key>' on every endpoint but /health.", group="server"
    )
    admin_api_key: str | None = option(
        None, "Require this key (not --api-key) on the admin endpoints: /flush_cache, /abort_request, "
        "/set_schedule_policy (with radixserve launch, also the router's worker management). It opens every "
        "other endpoint too. Default: the admin endpoints take --api-key like the rest.", group="server")
    enable_metrics: bool = option(False, "Serve Prometheus metrics at /metrics.", group="server")
    max_request_body_bytes: int = option(
        16 * 1024 * 1024, "Largest HTTP request body accepted; a larger one is answered 413 (default 16 MiB).",
        group="server")
    decode_log_interval: int = option(40, "Log one line of batch statistics every N decode steps.", group="server")
    log_level: str = option("info", "Log level of every process.", ("debug", "info", "warning", "error"), group="server")
    stream_interval: int = option(1, "Send streamed output every N tokens (1: every token).", group="server")
    dp_size: int = option(
        1, "Data parallelism: N scheduler processes, each with its own model copy, KV pool and radix cache, "
        "behind a controller process that spreads requests over them (each rank gets its share of the CPU "
        "threads unless --num-threads is set).", group="server")
    load_balance_method: str = option(
        "round_robin", "--dp-size: how the controller picks a rank for a request that names none "
        "(data_parallel_rank pins one): in turn, the fewest requests, or the fewest tokens.",
        ("round_robin", "shortest_queue", "minimum_tokens"), group="server")
    cache_events_port: int | None = option(
        None, "Publish the radix cache's changes (prefixes stored, evicted, cleared) on a ZeroMQ PUB socket "
        "at tcp://<--host>:<port>, one batch per scheduler step, for a router's --enable-cache-events "
        "(SGLang's --kv-events-config). --dp-size N: rank r uses port + r. /get_server_info reports the "
        "endpoint. Default: off.", group="server")
    kv_events_config: str | None = option(
        None, "Also publish the radix cache's changes in vLLM's KV-event schema (msgpack KVEventBatch of "
        "BlockStored / BlockRemoved / AllBlocksCleared, one block per page, with sequence numbers and an "
        "optional replay socket), for routers built on it (Dynamo, llm-d): vLLM's and SGLang's JSON, e.g. "
        "'{\"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\"}' "
        "(--dp-size N: rank r adds r to the ports). Default: off.", group="server")
    # NOTE: group "server", not a group of its own: the simulator builds its CLI from every group but
    # "model" and "server", and these mean nothing there.
    tp_size: int = option(
        1, "Tensor parallelism: shard every layer (attention heads, MLP, vocabulary) and the KV pool over N "
        "ranks, one process each, that run each step together over torch.distributed (gloo on CPU). The "
        "model's attention and KV head counts must be multiples of N (docs/scale-out.md).", group="server")
    nnodes: int = option(
        1, "--tp-size over several machines: the number of nodes; each runs --tp-size / --nnodes ranks.",
        group="server")
    node_rank: int = option(
        0, "This node's index in [0, --nnodes); node 0 runs the HTTP server and TP rank 0, the others only "
        "their TP ranks.", group="server")
    dist_init_addr: str | None = option(
        None, "host:port of torch.distributed's TCP store, served by TP rank 0 on node 0 (required with "
        "--nnodes > 1; default: a free local port).", group="server")


    @property
    def tp_ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes

    def _serving_errors(self) -> list[str]:
        errors: list[str] = []
        for name in ("decode_log_interval", "stream_interval", "dp_size", "max_request_body_bytes"):
            errors += not_positive(self, name, allow_none=False)
        if not 0 <= self.port <= 65535:
            errors.append(f"port must be in [0, 65535], got {self.port}")
        if not self.shutdown_grace_period_secs >= 0:
            errors.append(f"shutdown_grace_period_secs must be >= 0, got {self.shutdown_grace_period_secs}")
        if self.cache_events_port is not None:
            ranks = self.dp_size if isinstance(self.dp_size, int) and self.dp_size > 0 else 1
            last = self.cache_events_port + ranks - 1 if isinstance(self.cache_events_port, int) else 0
            if not isinstance(self.cache_events_port, int) or not 1 <= self.cache_events_port <= last <= 65535:
                errors.append(f"cache_events_port must be in [1, 65535] (with --dp-size N, port + N - 1 too), "
                              f"got {self.cache_events_port!r}")
            elif self.cache_events_port <= self.port <= last:
                errors.append(f"cache_events_port {self.cache_events_port} collides with the HTTP port {self.port}")
        if self.kv_events_config is not None:
            try:
                KVEventsConfig.parse(self.kv_events_config)
            except ValueError as e:
                errors.append(str(e))
        return errors + self._parallelism_errors()

    def _parallelism_errors(self) -> list[str]:
        errors = []
        for name in ("tp_size", "nnodes"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                errors.append(f"{name} must be a positive integer, got {v!r}")
        if errors:
            return errors
        if self.tp_size > 1 and self.dp_size > 1:
            errors.append("--tp-size and --dp-size > 1 together are not supported yet; use one or the other")
        if not isinstance(self.node_rank, int) or not 0 <= self.node_rank < self.nnodes:
            errors.append(f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank!r}")
        if self.tp_size % self.nnodes:
            errors.append(f"tp_size {self.tp_size} must be a multiple of nnodes {self.nnodes} "
                          "(each node runs tp_size / nnodes ranks)")
        if self.nnodes > 1 and self.dist_init_addr is None:
            errors.append("--nnodes > 1 needs --dist-init-addr host:port (reachable from every node)")
        if self.dist_init_addr is not None:
            host, sep, port = self.dist_init_addr.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
                errors.append(f"dist_init_addr must be host:port, got {self.dist_init_addr!r}")
        return errors
