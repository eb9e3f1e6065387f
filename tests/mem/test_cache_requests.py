"""``RadixCache`` from the requests' side: caching a finished request (its four regions) and an
unfinished one (tree slots swapped in, the lock moved), paged; reset; and ``ChunkCache``, which
shares nothing."""

from __future__ import annotations

from typing import Any

from radixserve.mem.base_cache import ChunkCache, RadixKey
from radixserve.mem.kv_pool import ReqToTokenPool
from radixserve.mem.radix_cache import RadixCache
from tests.mem.radix_helpers import (
    RecordingAllocator,
    check_accounting,
    make,
    node_of,
    put,
    sizes,
)

# --- requests --------------------------------------------------------------------------------


class FakeReq:
    """The attributes of ``CacheableReq``, nothing else."""

    def __init__(self, token_ids: list[int], req_pool_idx: int | None, extra_key: str | None = None) -> None:
        self.token_ids = token_ids
        self.req_pool_idx = req_pool_idx
        self.kv_indices: list[int] = []
        self.cache_protected_len = 0
        self.last_node: Any = None
        self.extra_key = extra_key

    @property
    def kv_token_ids(self) -> list[int]:
        return self.token_ids[: len(self.kv_indices)]


def admit(cache: RadixCache, req: FakeReq) -> None:
    """What the scheduler does: match, lock, take the prefix."""
    m = cache.match_prefix(RadixKey(req.token_ids, req.extra_key))
    cache.inc_lock_ref(m.last_node)
    req.last_node = m.last_node
    req.kv_indices = list(m.device_indices)
    req.cache_protected_len = len(m.device_indices)


def test_cache_finished_req_four_regions() -> None:
    cache, alloc = make(size=32, page_size=2)  # pages 1..16 = slots 2..33
    r2t = cache.req_to_token_pool
    put(cache, alloc, [10, 11])  # slots 2,3
    req = FakeReq([10, 11, 12, 13, 14, 15, 16, 17, 18], r2t.alloc())
    assert req.req_pool_idx == 0
    admit(cache, req)
    assert (req.kv_indices, req.cache_protected_len) == ([2, 3], 2)
    assert sizes(cache) == (0, 2)
    req.kv_indices += alloc.alloc_extend(3, 2, 7)  # tokens 2..8
    assert req.kv_indices == [2, 3, 4, 5, 6, 7, 8, 9, 10]
    # Meanwhile another request inserts [10,11,12,13] with its own page for 12,13.
    other = alloc.alloc(2)
    assert other == [12, 13]
    assert cache.insert(RadixKey([10, 11, 12, 13]), [2, 3, *other]) == 2
    assert sizes(cache) == (2, 2)
    alloc.freed.clear()

    cache.cache_finished_req(req)
    # [0,2) protected: kept; [2,4) duplicates of 12,13: freed; [4,8) new to the tree; [8,9) partial page: freed
    assert alloc.freed == [[4, 5], [10]]
    assert cache.match_prefix(RadixKey(req.token_ids)).device_indices.tolist() == [2, 3, 12, 13, 6, 7, 8, 9]
    assert sorted(cache.all_values()) == [2, 3, 6, 7, 8, 9, 12, 13]
    assert sizes(cache) == (8, 0)
    assert (req.req_pool_idx, req.kv_indices, req.cache_protected_len, req.last_node) == (None, [], 0, None)
    assert r2t.available_size() == r2t.size
    check_accounting(cache, alloc)
    assert alloc.available_size() == 24


def test_cache_finished_req_with_no_prefix_page1() -> None:
    cache, alloc = make(size=16)
    req = FakeReq([5, 6, 7], cache.req_to_token_pool.alloc())
    admit(cache, req)
    assert req.last_node is cache.root
    req.kv_indices += alloc.alloc(3)
    alloc.freed.clear()
    cache.cache_finished_req(req)
    assert alloc.freed == []  # everything went to the tree
    assert sizes(cache) == (3, 0)
    assert cache.match_prefix(RadixKey([5, 6, 7])).device_indices.tolist() == [1, 2, 3]
    check_accounting(cache, alloc)


def test_cache_unfinished_req_swaps_in_the_tree_slots_and_moves_the_lock() -> None:
    cache, alloc = make(size=16)
    r2t = cache.req_to_token_pool
    req = FakeReq([1, 2, 3, 4, 5, 6], r2t.alloc())
    admit(cache, req)  # nothing cached: last_node is the root
    own = alloc.alloc(4)  # first chunk: tokens 0..3
    assert own == [1, 2, 3, 4]
    req.kv_indices += own
    r2t.write(req.req_pool_idx, 0, own)
    # Meanwhile someone else caches [1, 2] with its own slots.
    theirs = alloc.alloc(2)
    assert theirs == [5, 6]
    assert cache.insert(RadixKey([1, 2]), theirs) == 0
    alloc.freed.clear()

    cache.cache_unfinished_req(req)
    assert alloc.freed == [[1, 2]]  # the request's copies of [1, 2]
    assert req.kv_indices == [5, 6, 3, 4]
    assert r2t.req_to_token[req.req_pool_idx, :4].tolist() == [5, 6, 3, 4]
    assert req.cache_protected_len == 4
    node = req.last_node
    assert node.key == [3, 4] and node.lock_ref == 1 and node.parent.lock_ref == 1
    assert sizes(cache) == (0, 4)
    check_accounting(cache, alloc)

    # Second chunk, then the request ends.
    more = alloc.alloc(2)
    assert more == [7, 8]
    req.kv_indices += more
    cache.cache_unfinished_req(req)  # nothing duplicated: the lock moves down to [5, 6]
    assert alloc.freed == [[1, 2]]
    assert node.lock_ref == 1  # still on the path of the new last_node; the old own lock is gone
    assert req.last_node.key == [5, 6] and req.last_node.lock_ref == 1
    assert sizes(cache) == (0, 6)
    cache.cache_finished_req(req)
    assert alloc.freed == [[1, 2]]
    assert sizes(cache) == (6, 0)
    assert cache.match_prefix(RadixKey([1, 2, 3, 4, 5, 6])).device_indices.tolist() == [5, 6, 3, 4, 7, 8]
    check_accounting(cache, alloc)


def test_cache_unfinished_req_paged_keeps_the_partial_page() -> None:
    cache, alloc = make(size=32, page_size=4)
    req = FakeReq(list(range(50, 60)), cache.req_to_token_pool.alloc())
    admit(cache, req)
    req.kv_indices += alloc.alloc_extend(None, 0, 6)
    assert req.kv_indices == [4, 5, 6, 7, 8, 9]
    cache.cache_unfinished_req(req)
    assert req.cache_protected_len == 4
    assert req.kv_indices == [4, 5, 6, 7, 8, 9]
    assert sizes(cache) == (0, 4)
    check_accounting(cache, alloc, held={8, 9, 10, 11})
    req.kv_indices += alloc.alloc_extend(9, 6, 3)
    assert req.kv_indices == [4, 5, 6, 7, 8, 9, 10, 11, 12]
    alloc.freed.clear()
    cache.cache_finished_req(req)
    assert alloc.freed == [[12]]  # the partial third page
    assert sizes(cache) == (8, 0)
    check_accounting(cache, alloc)


def test_reset_empties_the_tree() -> None:
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3])
    cache.inc_lock_ref(node_of(cache, [1, 2, 3]))
    cache.reset()
    assert sizes(cache) == (0, 0)
    assert cache.root.children == {}
    assert cache.match_prefix(RadixKey([1, 2, 3])).device_indices.tolist() == []
    assert cache.evict(10) == 0
    cache.check_integrity()


def test_chunk_cache_shares_nothing() -> None:
    alloc = RecordingAllocator(16, 1)
    r2t = ReqToTokenPool(2, 16)
    cache = ChunkCache(r2t, alloc)
    slots = alloc.alloc(3)
    assert cache.insert(RadixKey([1, 2, 3]), slots) == 0
    m = cache.match_prefix(RadixKey([1, 2, 3]))
    assert m.device_indices.tolist() == [] and m.last_node is cache.root
    assert cache.inc_lock_ref(cache.root) == 0 and cache.dec_lock_ref(cache.root) == 0
    assert (cache.evictable_size(), cache.protected_size(), cache.total_size()) == (0, 0, 0)
    assert cache.evict(100) == 0
    req = FakeReq([1, 2, 3], r2t.alloc())
    req.kv_indices = slots
    req.last_node = m.last_node
    cache.cache_unfinished_req(req)
    assert req.kv_indices == slots
    cache.cache_finished_req(req)
    assert alloc.freed == [[1, 2, 3]]
    assert alloc.available_size() == 16
    assert (req.req_pool_idx, req.kv_indices, req.last_node) == (None, [], None)
    assert r2t.available_size() == 2
    cache.check_integrity()
    cache.reset()
