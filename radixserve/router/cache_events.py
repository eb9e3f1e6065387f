"""The router's side of cache events: follow what a worker's radix cache really holds.

A worker started with ``--cache-events-port`` publishes an ``EventBatch`` per scheduler step on a
ZeroMQ PUB socket (``mem.cache_events``; ``/get_server_info`` says where). A
``CacheEventSubscriber`` per worker reads them in the router's event loop and applies each to the
policy's prefix tree for that worker's target (``apply_batch``):

- ``BlockStored(tokens)`` -> ``policy.on_cache_stored(target, tokens)``: the worker holds the path;
- ``BlockRemoved(tokens, keep)`` -> ``policy.on_cache_removed(target, tokens, keep)``: the worker
  dropped the path past ``keep``, so the tree drops the target from it (and from below it);
- ``AllCleared()`` -> ``policy.remove_target(target)``: the worker's cache is empty.

An event with a ``medium`` is about the worker's KV tier; the policy keeps it apart from the pool
(``CacheAware`` gives it partial credit).

The gap rule: batches are numbered 0, 1, 2, ... by the publisher. A batch whose ``seq`` is not
the last one plus 1 means batches were lost (PUB drops them past a high-water mark when this side
falls behind) or the worker restarted (a new publisher starts at 0 again, its cache empty). Either
way the tree may list prefixes the worker no longer has, and a removal that was lost will never be
repeated, so on a gap the target's tree state is dropped whole (``remove_target``) and rebuilt from
the events and routing that follow: forgetting costs some cache hits for a while, trusting stale
state would keep sending requests after prefixes that are gone. The first batch a subscriber sees
only sets the baseline: whatever was published before it connected was never applied.

Decoding is a msgpack decode of a typed struct and applying walks the tree, both short; the
subscriber yields to the event loop after each batch so a backlog does not hold up requests.
The events name tokens, so they only mean something to a tree keyed by tokens
(``--prefix-match tokens``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import msgspec
import zmq
import zmq.asyncio

from radixserve.mem.cache_events import AllCleared, BlockRemoved, BlockStored, EventBatch, decode_batch
from radixserve.router.policy import RouterPolicy

logger = logging.getLogger("radixserve.router")

# Batches the socket may queue while the event loop is busy; past it ZeroMQ drops them and the
# gap rule applies.
RCVHWM = 10_000


@runtime_checkable
class CacheEventTarget(Protocol):
    """What a policy must offer to follow cache events (``CacheAware`` does)."""

    def on_cache_stored(self, target_key: str, key: Sequence[Any], medium: str | None = None) -> None: ...

    def on_cache_removed(self, target_key: str, key: Sequence[Any], keep: int, medium: str | None = None) -> None: ...

    def remove_target(self, key: str) -> None: ...


def apply_batch(policy: CacheEventTarget, target_key: str, batch: EventBatch, last_seq: int | None) -> int:
    """Apply one batch to ``policy``'s view of ``target_key``; returns the new last seq.

    ``last_seq`` None: no batch seen yet (this one is the baseline). A break in ``seq`` drops
    what is known of the target before the batch is applied (the gap rule, module doc)."""
    if last_seq is not None and batch.seq != last_seq + 1:
        logger.warning("cache events of %s: batch %d after %d (%s); forgetting its prefixes", target_key,
                       batch.seq, last_seq, "lost batches" if batch.seq > last_seq else "publisher restarted")
        policy.remove_target(target_key)
    for ev in batch.events:
        if isinstance(ev, BlockStored):
            policy.on_cache_stored(target_key, ev.tokens, ev.medium)
        elif isinstance(ev, BlockRemoved):
            policy.on_cache_removed(target_key, ev.tokens, ev.keep, ev.medium)
        elif isinstance(ev, AllCleared):
            policy.remove_target(target_key)
    return batch.seq


class CacheEventSubscriber:
    """Reads one worker's cache events (``endpoint``, e.g. tcp://127.0.0.1:5557) into ``policy``
    for ``target_key``. ``start()`` in a running event loop; ``await stop()``."""

    def __init__(self, endpoint: str, target_key: str, policy: RouterPolicy) -> None:
        if not isinstance(policy, CacheEventTarget):
            raise TypeError(f"policy {policy.name!r} does not follow cache events (use cache_aware)")
        self.endpoint = endpoint
        self.target_key = target_key
        self.policy: CacheEventTarget = policy
        self.last_seq: int | None = None
        self.last_ts: float | None = None  # the worker's clock when it sent the last batch
        self.batches = 0
        self.events = 0
        self.gaps = 0
        self.errors = 0  # undecodable messages
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"cache-events {self.target_key}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def stats(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint, "last_seq": self.last_seq, "batches": self.batches,
                "events": self.events, "gaps": self.gaps, "errors": self.errors}

    async def receive(self, sock: zmq.asyncio.Socket) -> object:
        """The next message, as ``on_message`` takes it."""
        return await sock.recv()

    def on_message(self, raw: object) -> None:
        """Decode and apply one message (the loop's body; callable directly in tests)."""
        try:
            batch = decode_batch(raw)  # type: ignore[arg-type]
        except msgspec.DecodeError as e:
            self.errors += 1
            logger.warning("cache events of %s: undecodable message (%s)", self.target_key, e)
            return
        last = self.last_seq
        if last is not None and batch.seq != last + 1:
            self.gaps += 1
        try:
            apply_batch(self.policy, self.target_key, batch, last)
        except Exception:  # a bug here must not end the subscription, nor leave half a batch applied
            logger.exception("cache events of %s: applying batch %d failed; forgetting its prefixes",
                             self.target_key, batch.seq)
            self.policy.remove_target(self.target_key)
        self.last_seq = batch.seq
        self.last_ts = batch.ts
        self.batches += 1
        self.events += len(batch.events)

    async def _run(self) -> None:
        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.SUB)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, RCVHWM)
            if self.endpoint.startswith("tcp://["):
                sock.setsockopt(zmq.IPV6, 1)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(self.endpoint)
            logger.info("following the cache events of %s at %s", self.target_key, self.endpoint)
            while True:
                self.on_message(await self.receive(sock))
                # NOTE: recv of an already queued message completes without yielding; let the
                # requests run between batches of a backlog
                await asyncio.sleep(0)
        except zmq.ZMQError as e:
            logger.error("cache events of %s at %s: %s; the tree stays approximate", self.target_key,
                         self.endpoint, e)
        finally:
            sock.close(linger=0)
