"""``RadixCache.event_sink``: the exact cache events of an insert, a split, an eviction and a reset,
the batching of a step's events, and their wire format."""

from __future__ import annotations

import msgspec
import pytest

from radixserve.mem.base_cache import RadixKey
from radixserve.mem.cache_events import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    CacheEvent,
    EventBatch,
    EventBatcher,
    decode_batch,
    encode_batch,
)
from radixserve.mem.radix_cache import RadixCache
from tests.mem.radix_helpers import RecordingAllocator, check_accounting, make, put


def recording(size: int = 32, page_size: int = 1) -> tuple[RadixCache, RecordingAllocator, list[CacheEvent]]:
    cache, alloc = make(size, page_size)
    events: list[CacheEvent] = []
    cache.event_sink = events.append
    return cache, alloc, events


def test_unset_by_default_and_reports_nothing() -> None:
    cache, alloc = make()
    assert cache.event_sink is None
    put(cache, alloc, [1, 2, 3])
    assert cache.evict(3) == 3
    cache.reset()
    check_accounting(cache, alloc)


def test_insert_reports_the_full_path_only_when_something_is_new() -> None:
    cache, alloc, events = recording()
    put(cache, alloc, [1, 2, 3])
    assert events == [BlockStored([1, 2, 3])]
    put(cache, alloc, [1, 2, 3])  # all there already
    put(cache, alloc, [1, 2])  # a prefix of what is there: a split, no new prefix
    assert events == [BlockStored([1, 2, 3])]
    put(cache, alloc, [1, 2, 3, 4, 5])  # extends the leaf: the whole path from the root, new from 3
    assert events[1:] == [BlockStored([1, 2, 3, 4, 5], 3)]
    check_accounting(cache, alloc)


def test_insert_that_splits_reports_the_new_branch_from_the_root() -> None:
    cache, alloc, events = recording()
    put(cache, alloc, [1, 2, 3, 4])
    put(cache, alloc, [1, 2, 7, 8, 9])  # splits [1,2,3,4] at 2, adds [7,8,9] under [1,2]
    assert events == [BlockStored([1, 2, 3, 4]), BlockStored([1, 2, 7, 8, 9], 2)]
    assert sorted(len(c.key) for c in cache.root.children[(None, 1)].children.values()) == [2, 3]
    check_accounting(cache, alloc)


def test_a_split_by_match_reports_nothing() -> None:
    cache, alloc, events = recording()
    put(cache, alloc, [1, 2, 3, 4])
    events.clear()
    assert len(cache.match_prefix(RadixKey([1, 2, 9])).device_indices) == 2  # splits [1,2 | 3,4]
    assert events == []
    cache.check_integrity()


def test_eviction_reports_each_leaf_with_its_parent_path_kept() -> None:
    cache, alloc, events = recording()
    put(cache, alloc, [1, 2, 3, 4])
    put(cache, alloc, [1, 2, 7, 8, 9])  # [1,2] -> {[3,4], [7,8,9]}
    events.clear()
    assert cache.evict(2) == 2  # the LRU leaf [3,4]; [1,2] keeps a child
    assert events == [BlockRemoved([1, 2, 3, 4], keep=2)]
    check_accounting(cache, alloc)
    assert cache.evict(4) == 5  # [7,8,9], then [1,2], left childless
    assert events[1:] == [BlockRemoved([1, 2, 7, 8, 9], keep=2), BlockRemoved([1, 2], keep=0)]
    assert cache.total_size() == 0
    check_accounting(cache, alloc)


def test_reset_reports_all_cleared() -> None:
    cache, alloc, events = recording()
    put(cache, alloc, [1, 2, 3])
    cache.evict(3)
    cache.reset()
    assert events == [BlockStored([1, 2, 3]), BlockRemoved([1, 2, 3], keep=0), AllCleared()]
    check_accounting(cache, alloc)


def test_pages_report_whole_pages() -> None:
    cache, alloc, events = recording(size=32, page_size=2)
    put(cache, alloc, [1, 2, 3, 4, 5])  # the partial page [5] is not cached
    put(cache, alloc, [1, 2, 6, 7])
    assert events == [BlockStored([1, 2, 3, 4]), BlockStored([1, 2, 6, 7], 2)]
    events.clear()
    assert cache.evict(1) == 2
    assert events == [BlockRemoved([1, 2, 3, 4], keep=2)]
    check_accounting(cache, alloc)


def test_namespaced_keys_are_not_reported() -> None:
    cache, alloc, events = recording()
    put(cache, alloc, [1, 2, 3], extra_key="lora-a")
    put(cache, alloc, [1, 2, 3])
    assert events == [BlockStored([1, 2, 3])]
    assert cache.evict(6) == 6
    assert events[1:] == [BlockRemoved([1, 2, 3], keep=0)]  # the namespaced copy went silently
    check_accounting(cache, alloc)


def test_batcher_numbers_batches_and_skips_empty_steps() -> None:
    b = EventBatcher()
    assert b.take(1.0) is None
    b.add(BlockStored([1]))
    b.add(BlockRemoved([1], 0))
    assert b.take(2.0) == EventBatch(0, 2.0, [BlockStored([1]), BlockRemoved([1], 0)])
    assert b.take(3.0) is None
    b.add(BlockStored([2]))
    b.add(AllCleared())  # what came before a clear in the same step is dropped
    b.add(BlockStored([3]))
    assert b.take(4.0) == EventBatch(1, 4.0, [AllCleared(), BlockStored([3])])


def test_wire_format_round_trips_tagged() -> None:
    batch = EventBatch(7, 12.5, [BlockStored([1, 2]), BlockRemoved([1, 2], 1), AllCleared()])
    raw = encode_batch(batch)
    assert decode_batch(raw) == batch
    assert msgspec.msgpack.decode(raw) == {
        "seq": 7, "ts": 12.5,
        "events": [{"type": "stored", "tokens": [1, 2]}, {"type": "removed", "tokens": [1, 2], "keep": 1},
                   {"type": "cleared"}],
    }
    with pytest.raises(msgspec.DecodeError):
        decode_batch(msgspec.msgpack.encode({"seq": 1, "ts": 0.0, "events": [{"type": "nope"}]}))
