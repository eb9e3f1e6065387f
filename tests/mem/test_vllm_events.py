"""The radix cache's events in vLLM's KV-event schema: decoded here with structs written from
vLLM's definition (``vllm/distributed/kv_events.py``: tagged msgpack maps, defaults omitted, a
``KVEventBatch(ts, events, data_parallel_rank)``), every field checked against the tree."""

from __future__ import annotations

from typing import Any

import msgspec

from radixserve.mem.allocator import TokenToKVPoolAllocator
from radixserve.mem.base_cache import RadixKey
from radixserve.mem.cache_events import CacheEvent
from radixserve.mem.kv_pool import ReqToTokenPool
from radixserve.mem.radix_cache import RadixCache
from radixserve.mem.vllm_events import KVEventBatch, block_hash, chain_hashes, encode_kv_batch, to_vllm


# --- vLLM's definition, as its source has it (a consumer's view; not radixserve's structs) --------------
class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class VLLMKVEventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


DECODER = msgspec.msgpack.Decoder(VLLMKVEventBatch)
PAGE = 4


def _tree() -> tuple[RadixCache, TokenToKVPoolAllocator, list[CacheEvent]]:
    seen: list[CacheEvent] = []
    alloc = TokenToKVPoolAllocator(256, PAGE)
    return RadixCache(ReqToTokenPool(1, 8), alloc, event_sink=seen.append), alloc, seen


def _put(tree: RadixCache, alloc: TokenToKVPoolAllocator, ids: list[int]) -> None:
    slots = alloc.alloc(len(ids))
    alloc.free(slots[: tree.insert(RadixKey(ids), slots)])


def _round_trip(events: list[CacheEvent], rank: int = 0) -> VLLMKVEventBatch:
    return DECODER.decode(encode_kv_batch(KVEventBatch(123.5, to_vllm(events, PAGE), rank)))


def test_stores_evictions_and_a_flush_decode_as_vllm_defines_them() -> None:
    tree, alloc, seen = _tree()
    a = list(range(100, 112))  # three blocks
    b = a[:8] + [7, 7, 7, 7, 9, 9, 9, 9]  # shares two blocks, adds two
    _put(tree, alloc, a)
    _put(tree, alloc, b)
    _put(tree, alloc, b)  # already there: says nothing
    batch = _round_trip(seen, rank=3)
    assert (batch.ts, batch.data_parallel_rank) == (123.5, 3)
    first, second = batch.events
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
    ha, hb = chain_hashes(a, PAGE), chain_hashes(b, PAGE)
    assert (first.block_hashes, first.parent_block_hash, first.token_ids, first.block_size) == (ha, None, a, PAGE)
    assert (first.lora_id, first.medium, first.lora_name, first.extra_keys, first.group_idx) == (None,) * 5
    # b's new blocks chain on the block it shares with a
    assert second.parent_block_hash == ha[1] == hb[1] and second.block_hashes == hb[2:]
    assert second.token_ids == b[8:] and len(second.token_ids) == PAGE * len(second.block_hashes)
    assert hb[2] == block_hash(ha[1], b[8:12]) and hb[3] == block_hash(hb[2], b[12:16])

    seen.clear()
    tree.evict(tree.evictable_size())
    tree.reset()
    removed = _round_trip(seen).events
    assert isinstance(removed[-1], AllBlocksCleared)
    gone = [h for ev in removed[:-1] for h in ev.block_hashes if isinstance(ev, BlockRemoved)]
    assert sorted(gone) == sorted(set(ha) | set(hb))  # every stored block removed once, nothing else
    assert all(isinstance(ev, BlockRemoved) and ev.medium is None for ev in removed[:-1])


def test_hashes_depend_on_the_whole_prefix_only() -> None:
    a, b = list(range(12)), [99, 1, 2, 3] + list(range(4, 12))
    assert chain_hashes(a, PAGE) == chain_hashes(list(a), PAGE)  # the same on any worker
    assert chain_hashes(a, PAGE)[0] != chain_hashes(b, PAGE)[0]
    assert all(x != y for x, y in zip(chain_hashes(a, PAGE), chain_hashes(b, PAGE), strict=True))  # parents differ
    assert chain_hashes(a + [5], PAGE) == chain_hashes(a, PAGE)  # a partial block has no hash
    assert all(0 <= h < 1 << 63 for h in chain_hashes(a, PAGE))  # fits msgpack's int64
