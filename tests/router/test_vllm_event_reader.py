"""The router following a worker's cache through vLLM-schema KV events: a real ``RadixCache``'s
events, encoded as the worker's vLLM publisher encodes them, rebuild the same paths in a
``CacheAware`` tree as radixserve's own events do; blocks under a parent never announced are
skipped; a gap forgets the block map with the tree state."""

from __future__ import annotations

import pytest

from radixserve.mem.cache_events import EventBatcher
from radixserve.mem.vllm_events import (
    KVEventBatch,
    VLLMBlockRemoved,
    VLLMBlockStored,
    encode_kv_batch,
    to_vllm,
)
from radixserve.router.policy import CacheAware
from radixserve.router.vllm_event_reader import BlockPaths, VLLMEventSubscriber
from radixserve.server.kv_events import advertised_kv_endpoint
from tests.mem.radix_helpers import make, put
from tests.router.test_cache_events import cached, held


def _frames(seq: int, events: list) -> list[bytes]:  # type: ignore[type-arg]
    return [b"kv", seq.to_bytes(8, "big"), encode_kv_batch(KVEventBatch(ts=1.0, events=events))]


@pytest.mark.parametrize("page", [1, 4])
def test_vllm_events_of_a_radix_cache_rebuild_its_paths(page: int) -> None:
    cache, alloc = make(size=48, page_size=page)
    batcher = EventBatcher()
    cache.event_sink = batcher.add
    policy = CacheAware()
    sub = VLLMEventSubscriber("tcp://127.0.0.1:1", "w0", policy)
    prompts = ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 13],
               [12] * 16, [1, 2, 3, 4, 9, 9, 9, 9, 1, 1, 1, 1])
    sub.on_message(_frames(0, []))  # the baseline
    for seq, tokens in enumerate(prompts, start=1):
        put(cache, alloc, tokens)  # the pool fills: later puts evict earlier leaves first
        if alloc.available_size() < 16:
            cache.evict(16)
        b = batcher.take()
        assert b is not None
        sub.on_message(_frames(seq, to_vllm(b.events, page)))
        assert held(policy.tree, "w0") == cached(cache), seq
    assert sub.gaps == 0 and sub.errors == 0 and sub.last_seq == len(prompts)
    policy.tree.check_integrity()
    # every block the cache still holds is known to the reader, no more
    assert len(sub.paths.blocks) == sum(len(p) for p in cached(cache)) // page


def test_unplaceable_blocks_and_gaps() -> None:
    paths = BlockPaths()
    stored = VLLMBlockStored(block_hashes=[11, 12], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=2,
                             lora_id=None, medium=None, lora_name=None)
    orphan = VLLMBlockStored(block_hashes=[99], parent_block_hash=98, token_ids=[7, 7], block_size=2,
                             lora_id=None, medium=None, lora_name=None)
    child = VLLMBlockStored(block_hashes=[13], parent_block_hash=12, token_ids=[5, 6], block_size=2,
                            lora_id=None, medium=None, lora_name=None)
    out = paths.convert([stored, orphan, child])
    assert [(e.tokens, e.start) for e in out] == [([1, 2, 3, 4], 0), ([1, 2, 3, 4, 5, 6], 4)]  # type: ignore[union-attr]
    out = paths.convert([VLLMBlockRemoved(block_hashes=[12, 13], medium=None)])
    assert [(e.tokens, e.keep) for e in out] == [([1, 2, 3, 4], 2), ([1, 2, 3, 4, 5, 6], 4)]  # type: ignore[union-attr]
    assert set(paths.blocks) == {11}
    policy = CacheAware()
    sub = VLLMEventSubscriber("tcp://127.0.0.1:1", "w0", policy)
    sub.on_message(_frames(0, [stored]))
    sub.on_message(_frames(5, [child]))  # a gap: the tree state and the block map are forgotten
    assert sub.gaps == 1 and held(policy.tree, "w0") == set() and not sub.paths.blocks
    sub.on_message([b"kv", b"\x00" * 8, b"not msgpack"])
    assert sub.errors == 1


def test_workers_advertise_where_their_vllm_events_are() -> None:
    assert advertised_kv_endpoint(None, "127.0.0.1") is None
    assert advertised_kv_endpoint('{"endpoint": "tcp://*:5557"}', "10.1.2.3") == "tcp://10.1.2.3:5557"
    assert advertised_kv_endpoint('{"endpoint": "tcp://127.0.0.1:6000", "bind": true}', "x") == "tcp://127.0.0.1:6000"
    assert advertised_kv_endpoint('{"endpoint": "tcp://10.0.0.9:6000"}', "x") is None  # it connects out
    assert advertised_kv_endpoint('{"endpoint": "tcp://*:*"}', "x") is None  # its port is drawn at start
    assert advertised_kv_endpoint('{"endpoint": "tcp://*:5557", "enable_kv_cache_events": false}', "x") is None
