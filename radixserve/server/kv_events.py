"""The worker's side of ``--kv-events-config``: the radix cache's changes published in vLLM's
KV-event schema (``mem.vllm_events``) as vLLM's publisher sends them, for routers built on it.

Each scheduler step that changed the cache sends one multipart message on a PUB socket:
``[topic, seq, payload]``, ``seq`` an 8-byte big-endian count from 0 and ``payload`` a msgpack
``KVEventBatch``. The last ``buffer_steps`` messages are kept; with a ``replay_endpoint``, a ROUTER
socket answers a request ``[identity, b"", start_seq]`` with ``[identity, b"", seq, payload]`` for
every kept batch from ``start_seq`` on, then ``[identity, b"", -1, b""]``: a subscriber that saw a
gap in ``seq`` asks for what it missed. The replay socket has a thread of its own, so a replay is
answered while the scheduler waits for work; the PUB socket is the scheduler thread's.

``open_cache_events`` opens a rank's publishers (this one, ``--cache-events-port``'s or both) as
the one event sink the radix cache is built with (``EventPublishers``).
"""

from __future__ import annotations

import logging
import threading
from collections import deque

import zmq

from radixserve.config.kv_events import KVEventsConfig
from radixserve.config.serving import ServingOptions
from radixserve.mem.cache_events import CacheEvent, EventBatcher
from radixserve.mem.vllm_events import KVEventBatch, encode_kv_batch, to_vllm
from radixserve.server.cache_events import CacheEventPublisher, advertised_host, bind_endpoint

logger = logging.getLogger(__name__)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def rank_endpoint(endpoint: str, dp_rank: int) -> str:
    """Rank ``dp_rank``'s endpoint: a tcp port moved by the rank (a ``*`` port stays: each rank
    gets a free one), an inproc/ipc name suffixed."""
    if dp_rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        return endpoint if port == "*" else f"{host}:{int(port) + dp_rank}"
    return f"{endpoint}_dp{dp_rank}"


def advertised_kv_endpoint(kv_events_config: str | None, host: str) -> str | None:
    """Where a subscriber connects for rank 0's vLLM-schema events (``/get_server_info``'s
    ``kv_events_endpoint``): the bound endpoint with a wildcard host replaced by the server's; None
    when nothing is published, the publisher connects out, or its port is drawn at start."""
    if kv_events_config is None:
        return None
    cfg = KVEventsConfig.parse(kv_events_config)
    ep = cfg.endpoint
    if not cfg.enabled or not _binds(ep, cfg.bind) or not ep.startswith(("tcp://", "ipc://")):
        return None
    if ep.startswith("ipc://"):
        return ep
    where, _, port = ep.rpartition(":")
    if port == "*":
        return None
    if where in ("tcp://*", "tcp://0.0.0.0", "tcp://[::]"):
        return f"tcp://{advertised_host(host)}:{port}"
    return ep


def _binds(endpoint: str, bind: bool | None) -> bool:
    """Whether the socket binds: as ``bind`` says, else as vLLM decides (a wildcard host, ipc or
    inproc binds; a plain address is connected to)."""
    if bind is not None:
        return bind
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _open(sock: zmq.Socket, endpoint: str, bind: bool | None) -> str:
    """Bind or connect (``_binds``); returns the endpoint (a bound wildcard port as the one it got)."""
    if not _binds(endpoint, bind):
        sock.connect(endpoint)
        return endpoint
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as e:
        sock.close(linger=0)
        raise OSError(f"cannot bind the KV events socket at {endpoint}: {e}") from None
    return str(sock.getsockopt_string(zmq.LAST_ENDPOINT))


class VLLMEventPublisher:
    """Collects a step's cache events (``add``, beside the radix cache's other sinks) and sends them
    as one ``KVEventBatch`` (``flush``, once per step)."""

    def __init__(self, ctx: zmq.Context, cfg: KVEventsConfig, dp_rank: int, block_size: int) -> None:
        self.cfg = cfg
        self.dp_rank = dp_rank
        self.block_size = block_size
        self.batcher = EventBatcher()  # a step's events, numbered as the batches they go out in
        self.add = self.batcher.add
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=max(cfg.buffer_steps, 1))
        self.topic = cfg.topic.encode()
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.set_hwm(cfg.hwm)
        self.endpoint = _open(self.pub, rank_endpoint(cfg.endpoint, dp_rank), cfg.bind)
        self.replay: zmq.Socket | None = None
        self.replay_endpoint: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if cfg.replay_endpoint:
            self.replay = ctx.socket(zmq.ROUTER)
            self.replay.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = _open(self.replay, rank_endpoint(cfg.replay_endpoint, dp_rank), True)
            self._thread = threading.Thread(target=self._serve_replays, name="kv-events-replay", daemon=True)
            self._thread.start()

    @property
    def seq(self) -> int:
        """The next batch's number."""
        return self.batcher.seq

    def flush(self) -> bool:
        """Send what the step reported, if anything; True when a batch went out."""
        batch = self.batcher.take()
        if batch is None:
            return False
        payload = encode_kv_batch(KVEventBatch(batch.ts, to_vllm(batch.events, self.block_size), self.dp_rank))
        seq = batch.seq
        self.buffer.append((seq, payload))
        try:
            self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
        except zmq.Again:  # past the high-water mark: the subscriber sees the gap and can replay
            return False
        return True

    def _serve_replays(self) -> None:
        sock = self.replay
        assert sock is not None
        while not self._stop.is_set():
            if not sock.poll(100):
                continue
            frames = sock.recv_multipart()
            if len(frames) != 3:
                logger.warning("kv events: a replay request of %d frames, not 3: ignored", len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self.buffer):  # a copy: the scheduler thread appends meanwhile
                if seq >= first:
                    sock.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            sock.send_multipart((client, b"", END_SEQ, b""))

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        self.pub.close(linger=0)
        if self.replay is not None:
            self.replay.close(linger=0)


class EventPublishers:
    """The cache's event sink when it has several publishers (ours, vLLM's schema): each gets
    every event and flushes its own batch."""

    def __init__(self, publishers: list[CacheEventPublisher | VLLMEventPublisher]) -> None:
        self.publishers = publishers

    def add(self, event: CacheEvent) -> None:
        for p in self.publishers:
            p.add(event)

    def flush(self) -> None:
        for p in self.publishers:
            p.flush()

    def close(self) -> None:
        for p in self.publishers:
            p.close()


def open_cache_events(ctx: zmq.Context, args: ServingOptions, dp_rank: int, page_size: int = 1
                      ) -> EventPublishers | None:
    """Open this rank's cache event sockets (``--cache-events-port``, ``--kv-events-config``), for
    the radix cache to be built with (None when both are off; ServerArgs refuses them with
    --disable-radix-cache)."""
    publishers: list[CacheEventPublisher | VLLMEventPublisher] = []
    if args.cache_events_port is not None:
        ours = CacheEventPublisher(ctx, bind_endpoint(args.host, args.cache_events_port + dp_rank))
        logger.info("publishing cache events on %s", ours.endpoint)
        publishers.append(ours)
    cfg = KVEventsConfig.parse(args.kv_events_config) if args.kv_events_config is not None else None
    if cfg is not None and cfg.enabled:
        vllm = VLLMEventPublisher(ctx, cfg, dp_rank, page_size)
        logger.info("publishing KV events (vLLM's schema) on %s", vllm.endpoint)
        publishers.append(vllm)
    return EventPublishers(publishers) if publishers else None
