"""The persistent eviction heap (``mem.leaf_heap``) evicts exactly what a fresh heap per call did,
and stays consistent through locks, unlocks, inserts, splits, touches and evictions."""

from __future__ import annotations

import heapq
import random
from typing import Any

import pytest

from radixserve.mem.allocator import TokenToKVPoolAllocator
from radixserve.mem.base_cache import RadixKey
from radixserve.mem.evict_policy import QueueAwareStrategy, get_eviction_strategy
from radixserve.mem.kv_pool import ReqToTokenPool
from radixserve.mem.leaf_heap import LeafHeap
from radixserve.mem.radix_cache import RadixCache
from tests.mem.radix_helpers import RecordingAllocator


class FreshHeapCache(RadixCache):
    """The reference: the eviction that rebuilt a heap of every evictable leaf on each call."""

    def evict(self, num_tokens: int) -> int:
        if num_tokens <= 0 or not self._leaves:
            return 0
        prio = self.strategy.priority
        heap = [(prio(n), n) for n in self._leaves]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, node = heapq.heappop(heap)
            if node not in self._leaves:
                continue
            self.allocator.free(node.value)
            freed += len(node.value)
            self._delete_leaf(node)
            parent = node.parent
            if parent in self._leaves:
                heapq.heappush(heap, (prio(parent), parent))
        return freed


class NonMonotone:
    """A strategy without ``monotone``: the heap is rebuilt on every call (the old behaviour)."""

    def priority(self, node: Any) -> Any:
        return (-len(node.key), node.id)


def _flat(calls: list[list[int]]) -> list[int]:
    """The slots freed, call after call (``RadixCache.evict`` frees a whole eviction in one call)."""
    return [s for call in calls for s in call]


def _pair(policy: str, page_size: int) -> list[tuple[RadixCache, RecordingAllocator]]:
    out = []
    for cls in (RadixCache, FreshHeapCache):
        alloc = RecordingAllocator(2048, page_size)
        strategy: Any = NonMonotone() if policy == "non-monotone" else get_eviction_strategy(policy)
        out.append((cls(ReqToTokenPool(1, 8), alloc, strategy), alloc))
    return out


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("policy", ["lru", "lfu", "queue-aware", "non-monotone"])
def test_same_victims_as_a_fresh_heap_through_random_operations(policy: str, page_size: int) -> None:
    rng = random.Random(hash((policy, page_size)) & 0xFFFF)
    caches = _pair(policy, page_size)
    locked: list[list[Any]] = [[], []]

    def seq() -> list[int]:
        return [rng.randrange(1, 5) for _ in range(rng.randrange(1, 40))]

    for step in range(600):
        op = rng.random()
        ids = seq()
        arg = rng.randrange(1, 80)
        pick = rng.random()
        wanted_ids = {rng.randrange(1, 400) for _ in range(rng.randrange(0, 30))}
        for k, (cache, alloc) in enumerate(caches):
            if op < 0.35:  # insert (splits nodes on the way)
                n = len(ids) - len(ids) % page_size
                if n and alloc.available_size() >= n + 64:
                    vals = alloc.alloc(n)
                    dup = cache.insert(RadixKey(ids[:n]), vals)
                    alloc.free(vals[:dup])
            elif op < 0.55:  # touch (and split): changes LRU/LFU priorities of waiting leaves
                cache.match_prefix(RadixKey(ids))
            elif op < 0.7:  # lock a match
                node = cache.match_prefix(RadixKey(ids)).last_node
                cache.inc_lock_ref(node)
                locked[k].append(node)
            elif op < 0.8:  # unlock one
                if locked[k]:
                    cache.dec_lock_ref(locked[k].pop(int(pick * len(locked[k]))))
            elif op < 0.9:
                alloc.freed.clear()
                cache.evict(arg)
            elif isinstance(cache.strategy, QueueAwareStrategy):
                cache.strategy.wanted = wanted_ids  # may lower some priorities: epoch bump
        a, b = caches[0][1], caches[1][1]
        assert _flat(a.freed) == _flat(b.freed), step  # the same slots, in the same order
        assert caches[0][0].evictable_size() == caches[1][0].evictable_size()
        caches[0][0].check_integrity()
    for cache, _ in caches:
        for node in locked[0 if cache is caches[0][0] else 1]:
            cache.dec_lock_ref(node)
    for _, alloc in caches:
        alloc.freed.clear()
    for cache, _ in caches:
        cache.evict(10**9)
    assert _flat(caches[0][1].freed) == _flat(caches[1][1].freed)
    assert caches[0][0].evictable_size() == 0
    caches[0][0].check_integrity()


def test_heap_stays_small_and_resets_with_the_tree() -> None:
    alloc = TokenToKVPoolAllocator(4096, 1)
    cache = RadixCache(ReqToTokenPool(1, 8), alloc)
    for i in range(200):
        vals = alloc.alloc(3)
        cache.insert(RadixKey([i + 1, 7, 7]), vals)
        for _ in range(5):
            cache.match_prefix(RadixKey([i + 1, 7]))  # touches, splits once
    assert len(cache._heap) <= 2 * len(cache._leaves) + 64
    cache.check_integrity()
    cache.evict(cache.evictable_size())
    cache.reset()
    cache.check_integrity()
    assert cache.evict(10) == 0


def test_swapping_the_strategy_rebuilds_the_heap() -> None:
    alloc = TokenToKVPoolAllocator(64, 1)
    cache = RadixCache(ReqToTokenPool(1, 8), alloc)
    for first in (1, 2, 3):
        cache.insert(RadixKey([first, 9]), alloc.alloc(2))
    s = QueueAwareStrategy()
    cache.strategy = s
    s.wanted = {n.id for n in cache._leaves if n.key[0] == 1}
    cache.check_integrity()
    assert cache.evict(1) == 2
    assert sorted(n.key[0] for n in cache._leaves) == [1, 3]  # the unwanted oldest went
    s.wanted = set()  # [1, 9] is unwanted now: its priority dropped, and it is the oldest
    assert cache.evict(1) == 2
    assert sorted(n.key[0] for n in cache._leaves) == [3]


@pytest.mark.parametrize("cycles", range(40, 75, 3))
def test_compaction_while_evicting_a_chain(cycles: int) -> None:
    """A chain evicted in one call (each parent becomes a leaf in turn) after many dead entries:
    the same victims as a fresh heap."""
    got = []
    for cls in (RadixCache, FreshHeapCache):
        alloc = RecordingAllocator(512, 1)
        cache = cls(ReqToTokenPool(1, 8), alloc)
        for k in range(1, 60):  # a chain: one node per length, only the deepest is a leaf
            vals = alloc.alloc(k)
            alloc.free(vals[: cache.insert(RadixKey(list(range(1, k + 1))), vals)])
        deepest = cache.match_prefix(RadixKey(list(range(1, 60)))).last_node
        for _ in range(cycles):  # each unlock pushes a new entry; the old ones are dead
            cache.inc_lock_ref(deepest)
            cache.dec_lock_ref(deepest)
        alloc.freed.clear()
        assert cache.evict(10**6) == 59
        got.append(_flat(alloc.freed))
        cache.check_integrity()
    assert got[0] == got[1]


class _Node:
    def __init__(self, i: int) -> None:
        self.id = i
        self.last_access_time = i
        self.heap_stamp = 0

    def __lt__(self, other: _Node) -> bool:
        return self.id < other.id


def test_pop_order_survives_a_compaction_between_two_pops() -> None:
    leaves: set[Any] = set()
    heap = LeafHeap(get_eviction_strategy("lru"), leaves)
    nodes = [_Node(i) for i in range(10)]
    for n in nodes:
        leaves.add(n)
        heap.push(n)
    order = heap.pop_order()
    first = next(order)
    leaves.discard(first)  # the caller evicts it
    for _ in range(80):  # pushes (as parents becoming leaves would) until the heap compacts
        heap.push(nodes[5])
    assert len(heap) <= 2 * len(leaves) + 64
    rest = []
    for n in order:
        leaves.discard(n)
        rest.append(n.id)
    assert [first.id, *rest] == list(range(10))
