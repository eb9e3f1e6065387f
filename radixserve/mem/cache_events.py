"""Cache events: what a worker's ``RadixCache`` tells the router about its real contents.

The router keeps its own guess of which worker holds which prefix (``router.tree.PrefixTree``);
these events let it follow what the worker's tree actually stores and, above all, evicts. Every
event names a path *from the root* because the router's tree is keyed from the root too:

- ``BlockStored(tokens, start)``: the path ``tokens`` is now cached whole, ``tokens[start:]``
  newly (an ``insert`` that added a node; an insert that only found what was there, or a split,
  changes no cached prefix and says nothing).
- ``BlockRemoved(tokens, keep)``: the tokens of the path past ``keep`` are no longer cached (an
  evicted leaf: ``tokens`` is its whole path, ``keep`` the length of its parent's path).
- ``AllCleared()``: the tree was emptied (``/flush_cache``), and the KV tier with it.

``medium`` says where: None for the KV pool (the radix tree), else the KV tier behind it
(``--enable-hierarchical-cache``), by vLLM's names: ``"DISK"`` for the file store, ``"CPU"`` for
memory. The tier reports its blocks (whole 64-token blocks from the root) as they are stored and
dropped; a router may give a prefix in the tier partial credit (it loads instead of computing).

With ``page_size > 1`` every length is a whole number of pages (the tree only holds pages).

Only the default namespace is reported: a node under an ``extra_key`` (a LoRA id, a cache salt)
is skipped, because the router routes by the prompt's tokens alone and could not tell two
namespaces' copies of the same tokens apart (reporting one's eviction would wrongly drop the other).

On the wire (``encode_batch`` / ``decode_batch``): one msgpack ``EventBatch(seq, ts, events)``
per scheduler step that produced events, the events tagged by ``type`` ("stored", "removed",
"cleared"). ``seq`` counts batches from 0 per publisher, so a subscriber sees a lost batch or a
restarted worker as a break in it. Nothing is pickled.
"""

from __future__ import annotations

import time
from typing import TypeAlias

import msgspec


class BlockStored(msgspec.Struct, tag="stored", tag_field="type", omit_defaults=True):
    tokens: list[int]  # the full cached path from the root
    start: int = 0  # tokens[:start] were cached before (the new node's first token)
    medium: str | None = None  # None: the pool; else the KV tier ("DISK", "CPU")


class BlockRemoved(msgspec.Struct, tag="removed", tag_field="type", omit_defaults=True):
    tokens: list[int]  # the full path from the root of the evicted node
    keep: int  # tokens[:keep] stay cached; tokens[keep:] are gone
    medium: str | None = None


class AllCleared(msgspec.Struct, tag="cleared", tag_field="type"):
    pass


CacheEvent: TypeAlias = BlockStored | BlockRemoved | AllCleared


class EventBatch(msgspec.Struct):
    seq: int  # 0, 1, 2, ... per publisher: a break means lost batches or a new publisher
    ts: float  # wall-clock time (time.time()) the batch was taken
    events: list[CacheEvent]


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(EventBatch)


def encode_batch(batch: EventBatch) -> bytes:
    return _ENCODER.encode(batch)


def decode_batch(data: bytes) -> EventBatch:
    """Raises ``msgspec.DecodeError`` (a ``ValueError``) on anything that is not an ``EventBatch``."""
    return _DECODER.decode(data)


class EventBatcher:
    """Collects the events of one scheduler step (``add``, the cache's ``event_sink``) and hands
    them out as one numbered batch (``take``), or nothing when the step produced none."""

    def __init__(self) -> None:
        self.pending: list[CacheEvent] = []
        self.seq = 0

    def add(self, event: CacheEvent) -> None:
        if isinstance(event, AllCleared):
            # what the step reported before a clear is moot: the subscriber drops it all anyway
            self.pending.clear()
        self.pending.append(event)

    def take(self, ts: float | None = None) -> EventBatch | None:
        if not self.pending:
            return None
        batch = EventBatch(self.seq, time.time() if ts is None else ts, self.pending)
        self.pending = []
        self.seq += 1
        return batch
