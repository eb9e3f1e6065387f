"""Helpers of the radix cache tests (test_radix_cache.py, test_cache_requests.py)."""

from __future__ import annotations

from radixserve.mem.allocator import TokenToKVPoolAllocator
from radixserve.mem.base_cache import RadixKey
from radixserve.mem.kv_pool import ReqToTokenPool
from radixserve.mem.radix_cache import RadixCache, TreeNode


class RecordingAllocator(TokenToKVPoolAllocator):
    """Logs every ``free`` call, so eviction order is visible slot by slot."""

    def __init__(self, size: int, page_size: int = 1) -> None:
        super().__init__(size, page_size)
        self.freed: list[list[int]] = []

    def free(self, slots: list[int]) -> None:
        if slots:
            self.freed.append(list(slots))
        super().free(slots)


def make(size: int = 32, page_size: int = 1, policy: str = "lru") -> tuple[RadixCache, RecordingAllocator]:
    alloc = RecordingAllocator(size, page_size)
    cache = RadixCache(ReqToTokenPool(4, 64), alloc, policy)
    return cache, alloc


def free_slots(a: TokenToKVPoolAllocator) -> set[int]:
    ps = a.page_size
    return {p * ps + o for p in range(1, a.num_pages + 1) if a._is_free[p] for o in range(ps)}


def put(cache: RadixCache, alloc: RecordingAllocator, tokens: list[int], extra_key: str | None = None) -> list[int]:
    """Insert ``tokens`` as a request would: fresh slots, duplicates freed. Returns its slots."""
    n = len(tokens) - len(tokens) % alloc.page_size
    slots = alloc.alloc(-(-len(tokens) // alloc.page_size) * alloc.page_size)[: len(tokens)]
    dup = cache.insert(RadixKey(tokens, extra_key), slots)
    alloc.free(slots[:dup])
    alloc.free(slots[n:])
    cache.check_integrity()
    return slots


def sizes(cache: RadixCache) -> tuple[int, int]:
    return cache.evictable_size(), cache.protected_size()


def check_accounting(cache: RadixCache, alloc: TokenToKVPoolAllocator, held: set[int] | None = None) -> None:
    """No slot is both free and in the tree; free + tree (+ held by requests) == the whole pool."""
    cache.check_integrity()
    tree = cache.all_values()
    assert len(tree) == len(set(tree)), "a slot is in the tree twice"
    free = free_slots(alloc)
    assert not (free & set(tree)), "a slot is both free and in the tree"
    held = held or set()
    assert free | set(tree) | held == set(range(alloc.page_size, alloc.size + alloc.page_size))
    assert alloc.available_size() + cache.total_size() + len(held) == alloc.size


def node_of(cache: RadixCache, tokens: list[int], extra_key: str | None = None) -> TreeNode:
    m = cache.match_prefix(RadixKey(tokens, extra_key))
    assert len(m.device_indices) == len(tokens) - len(tokens) % cache.page_size
    return m.last_node
