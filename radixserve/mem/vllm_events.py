"""The radix cache's events in vLLM's published KV-event schema, for the routers built on it
(Dynamo's KV router, llm-d, vLLM's production stack) to follow a radixserve worker's cache.

vLLM publishes ``KVEventBatch(ts, events, data_parallel_rank)`` of ``BlockStored``,
``BlockRemoved`` and ``AllBlocksCleared``: msgpack maps, the events tagged by their class name in
``type``, fields with a default left out when at it (``omit_defaults``). The structs below are
written from that definition (``vllm/distributed/kv_events.py``).

A block is one page of the tree (``block_size`` = ``--page-size``); only whole blocks exist, since
the tree caches whole pages. A block's hash chains its parent's: ``hash(parent, tokens)`` =
the first 8 bytes of BLAKE2b over the parent's hash and the block's token ids, as a non-negative
63-bit int (the root's parent is 0), so a path's hashes are the same on every worker and a
consumer can match a prompt's blocks against them. ``BlockStored`` carries the newly cached
blocks of a path (their hashes, the hash of the block before them, their tokens), ``BlockRemoved``
the hashes of an evicted node's blocks, ``AllBlocksCleared`` a flushed cache.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import Any

import msgspec

from radixserve.mem.cache_events import AllCleared, BlockRemoved, BlockStored, CacheEvent


class VLLMBlockStored(msgspec.Struct, omit_defaults=True, tag="BlockStored", tag_field="type"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class VLLMBlockRemoved(msgspec.Struct, omit_defaults=True, tag="BlockRemoved", tag_field="type"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class VLLMAllBlocksCleared(msgspec.Struct, omit_defaults=True, tag="AllBlocksCleared", tag_field="type"):
    pass


VLLMEvent = VLLMBlockStored | VLLMBlockRemoved | VLLMAllBlocksCleared


class KVEventBatch(msgspec.Struct, omit_defaults=True):
    ts: float
    events: list[VLLMEvent]
    data_parallel_rank: int | None = None


_ENCODER = msgspec.msgpack.Encoder()


def encode_kv_batch(batch: KVEventBatch) -> bytes:
    return _ENCODER.encode(batch)


def block_hash(parent: int, tokens: Sequence[int]) -> int:
    digest = hashlib.blake2b(parent.to_bytes(8, "big") + array("q", tokens).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def chain_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """The hash of each whole block of ``tokens`` (a path from the root), in order."""
    out: list[int] = []
    parent = 0
    for i in range(0, len(tokens) - len(tokens) % block_size, block_size):
        parent = block_hash(parent, tokens[i : i + block_size])
        out.append(parent)
    return out


def to_vllm(events: Sequence[CacheEvent], block_size: int) -> list[VLLMEvent]:
    """One step's cache events as vLLM's: a stored path's new blocks, an evicted node's blocks,
    a cleared cache."""
    out: list[VLLMEvent] = []
    for ev in events:
        if isinstance(ev, BlockStored):
            hashes = chain_hashes(ev.tokens, block_size)
            first = ev.start // block_size
            if first < len(hashes):
                out.append(VLLMBlockStored(
                    block_hashes=hashes[first:], parent_block_hash=hashes[first - 1] if first else None,
                    token_ids=list(ev.tokens[first * block_size : len(hashes) * block_size]),
                    block_size=block_size, lora_id=None, medium=ev.medium, lora_name=None))
        elif isinstance(ev, BlockRemoved):
            hashes = chain_hashes(ev.tokens, block_size)
            gone = hashes[ev.keep // block_size:]
            if gone:
                out.append(VLLMBlockRemoved(block_hashes=gone, medium=ev.medium))
        elif isinstance(ev, AllCleared):
            out.append(VLLMAllBlocksCleared())
    return out
