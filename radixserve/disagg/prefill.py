"""The prefill side: a bootstrap server (ZeroMQ ROUTER) and the rooms waiting to send.

A room is ready to send when both halves are here, in either order: the decode worker's
``Register`` (its receive endpoint) and this worker's finished prefill (the sampled first token and
the prompt's KV, copied out of the pool at once into one staging tensor per layer's K and V: the
pool's slots stay the radix cache's, evictable as usual, and no lock outlives the step). The copy is
kept until the decode worker's ``Ack``. Every half-open room expires after ``timeout_s`` and drops
its copy, so a decode worker that died or a room that never registers leaks nothing.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from radixserve.disagg.kv_memory import KVMemory
from radixserve.disagg.transfer import CONTROL_DEC, TRANSFER_BACKENDS, Ack, KVHeader, Register
from radixserve.mem.kv_pool import KVPool

logger = logging.getLogger(__name__)


@dataclass
class _Ready:
    header: KVHeader
    layers: list[Any]  # torch tensors, K and V of each layer ([] for an error room)
    since: float


@dataclass
class PrefillStats:
    rooms_sent: int = 0
    rooms_acked: int = 0
    rooms_expired: int = 0
    bytes_sent: int = 0
    tokens_sent: int = 0
    pages_sent: int = 0
    send_seconds: float = 0.0
    errors: list[str] = field(default_factory=list)


class PrefillRooms:
    def __init__(self, ctx: zmq.Context, endpoint: str, kv: KVMemory, pool: KVPool,
                 timeout_s: float, clock: Any = time.monotonic, backend: str = "zmq") -> None:
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(endpoint)
        self.endpoint = endpoint
        self.sender = TRANSFER_BACKENDS[backend][0](ctx)
        self.kv = kv
        self.pool = pool
        self.timeout_s = timeout_s
        self.clock = clock
        self.registered: dict[int, tuple[str, float]] = {}  # room -> (decode endpoint, since)
        self.ready: dict[int, _Ready] = {}
        self.in_flight: dict[int, _Ready] = {}  # sent, waiting for the ack
        self.stats = PrefillStats()

    @property
    def sockets(self) -> list[zmq.Socket]:
        return [self.router]

    def idle(self) -> bool:
        return not (self.registered or self.ready or self.in_flight)

    def on_prefilled(self, room: int, prompt: list[int], first_token: int | None, logprob: float | None,
                     error: str = "") -> None:
        """The prefill of ``room`` finished (its KV is in the radix cache now) or failed."""
        now = self.clock()
        if error or first_token is None:
            hdr = KVHeader(room, 0, -1, None, error or "the prefill worker produced no token")
            self.ready[room] = _Ready(hdr, [], now)
        else:
            slots = self.kv.cached_slots(prompt)
            layers = self.pool.gather(slots) if slots else []
            hdr = KVHeader(room, len(slots), first_token, logprob, kv_format=self.pool.format.name)
            self.ready[room] = _Ready(hdr, layers, now)
        self._try_send(room)

    def poll(self) -> None:
        """Drain the bootstrap socket, send what is ready, expire what waited too long."""
        while True:
            try:
                _ident, raw = self.router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            except ValueError:  # not two frames: not ours
                continue
            try:
                msg = CONTROL_DEC.decode(raw)
            except Exception:  # a stray peer must not take the scheduler down
                logger.warning("bootstrap server: undecodable message (%d bytes)", len(raw))
                continue
            if isinstance(msg, Register):
                self.registered[msg.room] = (msg.endpoint, self.clock())
                self._try_send(msg.room)
            elif isinstance(msg, Ack):
                r = self.in_flight.pop(msg.room, None)
                if r is not None:
                    self.stats.rooms_acked += 1
                    if not msg.ok:
                        logger.warning("decode worker refused room %d: %s", msg.room, msg.error)
        self._expire()

    def _try_send(self, room: int) -> None:
        if room not in self.ready or room not in self.registered:
            return
        r = self.ready.pop(room)
        endpoint, _ = self.registered.pop(room)
        t0 = time.perf_counter()
        try:
            n = self.sender.send(endpoint, r.header, r.layers)
        except zmq.ZMQError as e:
            logger.warning("room %d: sending KV to %s failed: %s", room, endpoint, e)
            return
        st = self.stats
        st.send_seconds += time.perf_counter() - t0
        st.rooms_sent += 1
        st.bytes_sent += n
        st.tokens_sent += r.header.num_tokens
        st.pages_sent += r.header.num_tokens // self.pool.page_size
        if not r.layers:
            return  # an error room: nothing to hold
        r.since = self.clock()
        self.in_flight[room] = r

    def _expire(self) -> None:
        limit = self.clock() - self.timeout_s
        for table in (self.ready, self.in_flight):
            for room in [k for k, r in table.items() if r.since < limit]:
                del table[room]
                self.stats.rooms_expired += 1
                logger.warning("room %d: no decode worker %s within %.0fs; its KV is released", room,
                               "registered" if table is self.ready else "acknowledged", self.timeout_s)
        for room in [k for k, (_, t) in self.registered.items() if t < limit]:
            del self.registered[room]
            self.stats.rooms_expired += 1

    def close(self) -> None:
        self.ready.clear()
        self.in_flight.clear()
        self.sender.close()
        self.router.close(0)
