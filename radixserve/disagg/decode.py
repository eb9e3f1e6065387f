"""The decode side: reserve KV for a room, register it with the prefill worker, receive its KV.

On arrival a request reserves the KV slots of its prompt (refused when the pool, evictable cache
included, cannot also keep ``headroom`` tokens free for decoding), registers its room with the
prefill worker's bootstrap server and waits. When the KV arrives it is written into the reserved
slots and inserted into the radix cache, locked until the scheduler admits the request (the caller
releases the lock then); the request then needs only an extend of its first token, a decode step.
A room with no KV after ``timeout_s`` frees its slots and comes back as failed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import zmq

from radixserve.disagg.kv_memory import KVMemory
from radixserve.disagg.transfer import TRANSFER_BACKENDS
from radixserve.mem.kv_pool import KVPool

logger = logging.getLogger(__name__)


class NoKVRoom(Exception):
    """The decode worker cannot reserve KV for this request now."""


@dataclass
class _Room:
    room: int
    bootstrap: str
    prompt: list[int]
    slots: list[int]
    payload: Any  # the caller's request object, handed back when the room completes
    since: float


@dataclass
class Arrived:
    """A room whose KV is in the radix cache (pinned by ``hold``) or that failed (``error`` says why,
    ``failure`` what kind of failure it was)."""

    payload: Any
    first_token: int = -1
    logprob: float | None = None
    hold: Any = None
    error: str = ""
    failure: RoomFailure | None = None


class RoomFailure(Enum):
    PREFILL_FAILED = "prefill_failed"  # the prefill worker reported an error for the room
    BAD_TRANSFER = "bad_transfer"  # the KV that came does not fit the room
    TIMED_OUT = "timed_out"  # no KV within --disaggregation-timeout-secs


@dataclass
class DecodeStats:
    rooms_received: int = 0
    rooms_refused: int = 0
    rooms_timed_out: int = 0
    rooms_failed: int = 0
    bytes_received: int = 0
    tokens_received: int = 0
    pages_received: int = 0


class DecodeRooms:
    def __init__(self, ctx: zmq.Context, host: str, kv: KVMemory, pool: KVPool, headroom: int, timeout_s: float,
                 clock: Any = time.monotonic, backend: str = "zmq",
                 on_kv: Callable[[list[int], list[int]], None] | None = None) -> None:
        """``on_kv(slots, tokens)``: told of every prompt's KV written into the pool (the runner's
        draft model then knows it lacks those positions)."""
        self.rx = TRANSFER_BACKENDS[backend][1](ctx, host)
        self.on_kv = on_kv
        self.kv = kv
        self.pool = pool
        self.headroom = headroom
        self.timeout_s = timeout_s
        self.clock = clock
        self.rooms: dict[int, _Room] = {}
        self.stats = DecodeStats()

    @property
    def sockets(self) -> list[zmq.Socket]:
        return [self.rx.pull]

    def idle(self) -> bool:
        return not self.rooms

    def open(self, room: int, bootstrap: str, prompt: list[int], payload: Any, busy_tokens: int = 0) -> None:
        """Reserve the prompt's KV and register the room. ``busy_tokens``: what the running batch may
        still take. Raises ``NoKVRoom`` (nothing reserved) or ``ValueError`` (a duplicate room)."""
        if room in self.rooms:
            raise ValueError(f"bootstrap_room {room} is already waiting for its KV")
        ps = self.kv.page_size
        need = -(-len(prompt) // ps) * ps
        free = self.kv.reclaimable_size()
        if need + self.headroom + busy_tokens > free:
            self.stats.rooms_refused += 1
            raise NoKVRoom(f"decode worker out of KV: the prompt needs {need} tokens + {self.headroom} "
                           f"reserved for decoding, {max(free - busy_tokens, 0)} can be had")
        slots = self.kv.reserve(need)  # fits: free + evictable covers it
        self.rooms[room] = _Room(room, bootstrap, list(prompt), slots, payload, self.clock())
        try:
            self.rx.register(bootstrap, room)
        except zmq.ZMQError as e:  # the send queue to that prefill worker is full: it is not reading
            self._drop(room)
            raise NoKVRoom(f"cannot register with the prefill worker at {bootstrap}: {e}") from e

    def poll(self) -> list[Arrived]:
        out: list[Arrived] = []
        while (msg := self.rx.recv()) is not None:
            hdr, frames = msg
            r = self.rooms.get(hdr.room)
            if r is None:  # timed out or aborted already; the prefill side's timeout releases its KV
                continue
            if hdr.error:
                self._drop(hdr.room)
                self.stats.rooms_failed += 1
                out.append(Arrived(r.payload, error=f"prefill worker failed: {hdr.error}",
                                   failure=RoomFailure.PREFILL_FAILED))
                continue
            try:
                n = hdr.num_tokens
                if n > len(r.slots) or n > len(r.prompt):
                    raise ValueError(f"{n} tokens of KV for a prompt of {len(r.prompt)}")
                if n and hdr.kv_format != self.pool.format.name:
                    raise ValueError(f"the prefill worker's KV is {hdr.kv_format or 'of an unnamed format'}, this "
                                     f"worker's {self.pool.format.name} (--kv-cache-dtype must match)")
                nbytes = self.pool.scatter(r.slots[:n], [f.buffer for f in frames]) if n else 0
            except ValueError as e:
                self._drop(hdr.room)
                self.stats.rooms_failed += 1
                self.rx.ack(r.bootstrap, hdr.room, False, str(e))
                out.append(Arrived(r.payload, error=f"bad KV transfer: {e}", failure=RoomFailure.BAD_TRANSFER))
                continue
            del self.rooms[hdr.room]
            if self.on_kv is not None and n:
                self.on_kv(r.slots[:n], r.prompt[:n])
            self.rx.ack(r.bootstrap, hdr.room, True)
            st = self.stats
            st.rooms_received += 1
            st.bytes_received += nbytes
            st.tokens_received += n
            st.pages_received += n // self.kv.page_size
            out.append(Arrived(r.payload, hdr.first_token, hdr.logprob, self.kv.adopt(r.prompt, r.slots, n)))
        now = self.clock()
        for room in [k for k, r in self.rooms.items() if now - r.since > self.timeout_s]:
            r = self.rooms[room]
            self._drop(room)
            self.stats.rooms_timed_out += 1
            out.append(Arrived(r.payload, error=f"no KV from the prefill worker at {r.bootstrap} for "
                                                f"bootstrap_room {room} within {self.timeout_s:g}s",
                               failure=RoomFailure.TIMED_OUT))
        return out

    def _drop(self, room: int) -> None:
        r = self.rooms.pop(room)
        self.kv.unreserve(r.slots)

    def abort(self, payload_match: Any) -> Any:
        """Drop the room whose payload ``payload_match(payload)`` is true; returns that payload."""
        for room, r in list(self.rooms.items()):
            if payload_match(r.payload):
                self._drop(room)
                return r.payload
        return None

    def close(self) -> None:
        for room in list(self.rooms):
            self._drop(room)
        self.rx.close()
