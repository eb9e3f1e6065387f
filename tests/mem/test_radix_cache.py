"""``RadixCache``: exact slots, sizes, lock counts and eviction order (the requests' side, caching
finished and unfinished requests, and ``ChunkCache``: test_cache_requests.py)."""

from __future__ import annotations

import pytest

from radixserve.mem.base_cache import RadixKey
from tests.mem.radix_helpers import (
    check_accounting,
    free_slots,
    make,
    node_of,
    put,
    sizes,
)

# --- match / insert --------------------------------------------------------------------------


def test_match_on_empty_tree() -> None:
    cache, alloc = make()
    m = cache.match_prefix(RadixKey([1, 2, 3]))
    assert m.device_indices.tolist() == []
    assert m.last_node is cache.root
    assert cache.match_prefix(RadixKey([])).device_indices.tolist() == []
    assert sizes(cache) == (0, 0)
    assert cache.root.children == {}
    cache.check_integrity()


def test_insert_returns_length_already_present() -> None:
    cache, alloc = make()
    assert cache.insert(RadixKey([1, 2, 3]), [11, 12, 13]) == 0  # fresh
    assert sizes(cache) == (3, 0)
    assert cache.insert(RadixKey([1, 2, 3]), [21, 22, 23]) == 3  # duplicate: caller frees its copy
    assert sizes(cache) == (3, 0)
    assert cache.insert(RadixKey([1, 2, 4, 5]), [31, 32, 33, 34]) == 2  # partial overlap: splits
    assert sizes(cache) == (5, 0)
    assert cache.insert(RadixKey([1, 2]), [41, 42]) == 2  # a prefix of what is there
    assert cache.insert(RadixKey([1, 2, 3, 6]), [51, 52, 53, 54]) == 3
    assert cache.insert(RadixKey([9]), [61]) == 0
    assert sizes(cache) == (7, 0)
    assert cache.insert(RadixKey([]), []) == 0
    cache.check_integrity()
    # The tree keeps the first inserter's slots.
    assert cache.match_prefix(RadixKey([1, 2, 3, 6, 7])).device_indices.tolist() == [11, 12, 13, 54]
    assert cache.match_prefix(RadixKey([1, 2, 4, 5])).device_indices.tolist() == [11, 12, 33, 34]
    assert sorted(cache.all_values()) == [11, 12, 13, 33, 34, 54, 61]
    with pytest.raises(ValueError):
        cache.insert(RadixKey([7, 8, 9]), [1, 2])


def test_match_splits_node_without_changing_sizes() -> None:
    cache, alloc = make()
    slots = put(cache, alloc, [1, 2, 3, 4, 5])
    assert slots == [1, 2, 3, 4, 5]
    (only,) = cache.root.children.values()
    m = cache.match_prefix(RadixKey([1, 2, 3, 9]))
    assert m.device_indices.tolist() == [1, 2, 3]
    upper = m.last_node
    assert upper.key == [1, 2, 3] and list(upper.value) == [1, 2, 3]
    assert upper.parent is cache.root
    assert list(upper.children.values()) == [only]
    assert only.key == [4, 5] and list(only.value) == [4, 5] and only.parent is upper
    assert sizes(cache) == (5, 0)
    assert cache.total_size() == 5
    cache.check_integrity()
    # A match that ends on the new boundary splits nothing more.
    assert cache.match_prefix(RadixKey([1, 2, 3])).last_node is upper
    # A longer key than the tree matches it all.
    m = cache.match_prefix(RadixKey([1, 2, 3, 4, 5, 6, 7]))
    assert m.device_indices.tolist() == [1, 2, 3, 4, 5] and m.last_node is only
    # A match that diverges inside a node splits it again.
    m = cache.match_prefix(RadixKey([1, 7]))
    assert m.device_indices.tolist() == [1]
    assert m.last_node.key == [1] and m.last_node.parent is cache.root
    assert sizes(cache) == (5, 0)
    assert m.last_node.lock_ref == 0  # match never locks
    check_accounting(cache, alloc)


def test_split_of_a_locked_node_keeps_lock_counts() -> None:
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3, 4])
    leaf = node_of(cache, [1, 2, 3, 4])
    cache.inc_lock_ref(leaf)
    cache.inc_lock_ref(leaf)
    assert sizes(cache) == (0, 4)
    upper = cache.match_prefix(RadixKey([1, 2, 9])).last_node
    assert upper.lock_ref == 2 and leaf.lock_ref == 2
    assert sizes(cache) == (0, 4)
    cache.check_integrity()
    assert cache.dec_lock_ref(leaf) == 0
    assert cache.dec_lock_ref(leaf) == 4
    assert sizes(cache) == (4, 0)
    cache.check_integrity()


# --- locks -----------------------------------------------------------------------------------


def test_lock_moves_exactly_the_path_between_evictable_and_protected() -> None:
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3, 4, 5])
    put(cache, alloc, [1, 2, 3, 6])
    put(cache, alloc, [7, 8])
    # Tree: [1,2,3] -> {[4,5], [6]}; [7,8]
    a = node_of(cache, [1, 2, 3, 4, 5])
    b = node_of(cache, [1, 2, 3, 6])
    mid = a.parent
    assert mid is b.parent and mid.key == [1, 2, 3]
    assert sizes(cache) == (8, 0)

    assert cache.inc_lock_ref(a) == -5
    assert sizes(cache) == (3, 5)
    assert (a.lock_ref, mid.lock_ref, b.lock_ref) == (1, 1, 0)
    assert cache.inc_lock_ref(a) == 0
    assert (a.lock_ref, mid.lock_ref) == (2, 2)
    assert cache.inc_lock_ref(b) == -1
    assert sizes(cache) == (2, 6)
    assert (a.lock_ref, mid.lock_ref, b.lock_ref) == (2, 3, 1)
    assert cache.root.lock_ref == 1  # the root's own pin, untouched
    cache.check_integrity()

    assert cache.dec_lock_ref(a) == 0
    assert cache.dec_lock_ref(a) == 2  # [4,5] unlocked; [1,2,3] still held through b
    assert sizes(cache) == (4, 4)
    assert (a.lock_ref, mid.lock_ref, b.lock_ref) == (0, 1, 1)
    cache.check_integrity()
    assert cache.dec_lock_ref(b) == 4
    assert sizes(cache) == (8, 0)
    assert (a.lock_ref, mid.lock_ref, b.lock_ref) == (0, 0, 0)
    cache.check_integrity()
    with pytest.raises(RuntimeError, match="unlocked"):
        cache.dec_lock_ref(b)
    assert cache.inc_lock_ref(cache.root) == 0 and cache.dec_lock_ref(cache.root) == 0


# --- eviction --------------------------------------------------------------------------------


def test_lru_eviction_order_follows_access_order() -> None:
    cache, alloc = make()
    sa = put(cache, alloc, [1, 1])  # slots 1,2
    sb = put(cache, alloc, [2, 2, 2])  # slots 3,4,5
    sc = put(cache, alloc, [3])  # slot 6
    assert (sa, sb, sc) == ([1, 2], [3, 4, 5], [6])
    cache.match_prefix(RadixKey([1, 1]))  # a is now the most recent; b the least
    alloc.freed.clear()
    assert cache.evict(1) == 3  # a whole leaf goes
    assert alloc.freed == [[3, 4, 5]]
    assert sizes(cache) == (3, 0)
    assert cache.evict(2) == 3  # c (1 slot) is not enough, then a
    assert alloc.freed == [[3, 4, 5], [6, 1, 2]]  # one free per evict call, leaves in order
    assert sizes(cache) == (0, 0)
    assert cache.evict(5) == 0
    assert cache.evict(0) == 0
    check_accounting(cache, alloc)
    assert alloc.available_size() == 32


def test_eviction_walks_up_a_parent_after_its_last_child() -> None:
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3])  # slots 1,2,3
    put(cache, alloc, [1, 2, 4])
    put(cache, alloc, [9, 9])
    # put() allocates 3 fresh slots for [1,2,4] (4,5,6) and frees the duplicated two (4,5).
    assert cache.match_prefix(RadixKey([1, 2, 4])).device_indices.tolist() == [1, 2, 6]
    assert cache.match_prefix(RadixKey([9, 9])).device_indices.tolist() == [7, 8]
    cache.match_prefix(RadixKey([1, 2, 3]))  # [3] and its parent [1,2] are the most recent
    alloc.freed.clear()
    assert cache.evict(100) == 6
    # [4] (oldest), [9,9], then [3], whose parent [1,2] then becomes a leaf and goes last.
    assert alloc.freed == [[6, 7, 8, 3, 1, 2]]  # one free per evict call, leaves in order
    assert cache.root.children == {}
    check_accounting(cache, alloc)


def test_lfu_eviction_order() -> None:
    cache, alloc = make(policy="lfu")
    put(cache, alloc, [1])  # slot 1
    put(cache, alloc, [2])  # slot 2
    put(cache, alloc, [3])  # slot 3
    put(cache, alloc, [4])  # slot 4
    for _ in range(3):
        cache.match_prefix(RadixKey([1]))
    cache.match_prefix(RadixKey([2]))
    cache.match_prefix(RadixKey([3]))
    cache.match_prefix(RadixKey([2]))
    cache.match_prefix(RadixKey([4]))  # hits: 1->3, 2->2, 3->1, 4->1 (4 more recent than 3)
    alloc.freed.clear()
    assert cache.evict(4) == 4
    assert alloc.freed == [[3, 4, 2, 1]]  # one free per evict call, leaves in order
    # The same accesses under LRU give recency order instead.
    lru, lalloc = make(policy="lru")
    for t in (1, 2, 3, 4):
        put(lru, lalloc, [t])
    for t in (1, 1, 1, 2, 3, 2, 4):
        lru.match_prefix(RadixKey([t]))
    lalloc.freed.clear()
    lru.evict(4)
    assert lalloc.freed == [[1, 3, 2, 4]]


def test_unknown_eviction_policy() -> None:
    with pytest.raises(ValueError, match="unknown radix eviction policy"):
        make(policy="fifo")


def test_locked_nodes_are_never_evicted() -> None:
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3])  # 1,2,3
    put(cache, alloc, [1, 2, 5, 6])  # 6,7 (4,5 dup-freed)
    put(cache, alloc, [8])  # 8: released slots are reused only once the never-used ones run out
    locked = node_of(cache, [1, 2, 5, 6])
    assert cache.inc_lock_ref(locked) == -4
    alloc.freed.clear()
    assert cache.evict(1000) == 2  # only [3] and [8]
    assert sorted(s for f in alloc.freed for s in f) == [3, 8]
    assert sizes(cache) == (0, 4)
    assert cache.match_prefix(RadixKey([1, 2, 5, 6])).device_indices.tolist() == [1, 2, 6, 7]
    check_accounting(cache, alloc)
    assert cache.evict(1000) == 0
    # Unlocking makes the whole path evictable again, leaf first.
    assert cache.dec_lock_ref(locked) == 4
    alloc.freed.clear()
    assert cache.evict(1000) == 4
    assert alloc.freed == [[6, 7, 1, 2]]  # one free per evict call, leaves in order
    check_accounting(cache, alloc)


def test_parent_becomes_evictable_when_its_last_child_goes() -> None:
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3])  # 1,2,3
    put(cache, alloc, [1, 2, 4])  # 6
    c3 = node_of(cache, [1, 2, 3])
    parent = c3.parent
    cache.inc_lock_ref(c3)
    assert parent not in cache._leaves
    alloc.freed.clear()
    assert cache.evict(100) == 1
    assert alloc.freed == [[6]]
    assert parent.children == {3: c3}
    assert cache.dec_lock_ref(c3) == 3
    assert c3 in cache._leaves and parent not in cache._leaves
    assert cache.evict(1) == 1
    assert alloc.freed == [[6], [3]]
    assert parent in cache._leaves  # childless and unlocked now
    assert sizes(cache) == (2, 0)
    assert cache.evict(1) == 2
    assert alloc.freed == [[6], [3], [1, 2]]
    check_accounting(cache, alloc)


def test_evicted_slots_go_back_to_the_allocator_and_are_reused() -> None:
    cache, alloc = make(size=8)
    put(cache, alloc, [1, 2, 3, 4])  # 1..4
    put(cache, alloc, [5, 6, 7, 8])  # 5..8
    assert alloc.available_size() == 0
    check_accounting(cache, alloc)
    cache.match_prefix(RadixKey([1]))
    assert cache.evict(3) == 4  # [5..8] is the least recent leaf
    assert free_slots(alloc) == {5, 6, 7, 8}
    check_accounting(cache, alloc)
    fresh = alloc.alloc(4)
    assert fresh == [5, 6, 7, 8]
    check_accounting(cache, alloc, held=set(fresh))
    assert not (set(fresh) & set(cache.all_values()))


# --- pages -----------------------------------------------------------------------------------


def test_page_aligned_keys_and_matches() -> None:
    cache, alloc = make(size=32, page_size=4)  # slots 4..35
    toks = list(range(100, 110))  # 10 tokens: 2 whole pages + 2
    slots = put(cache, alloc, toks)
    assert slots == list(range(4, 14))  # pages 1, 2, 3 (page 3 partly used, freed by put)
    assert sizes(cache) == (8, 0)
    assert sorted(cache.all_values()) == list(range(4, 12))
    assert cache.match_prefix(RadixKey(toks)).device_indices.tolist() == list(range(4, 12))
    assert cache.match_prefix(RadixKey(toks[:7])).device_indices.tolist() == list(range(4, 8))
    assert cache.match_prefix(RadixKey(toks[:3])).device_indices.tolist() == []  # less than a page
    # A match diverging inside the second page ends on the page boundary: splits at 4.
    m = cache.match_prefix(RadixKey(toks[:6] + [0, 0, 0, 0]))
    assert m.device_indices.tolist() == [4, 5, 6, 7]
    assert m.last_node.key == toks[:4]
    assert sizes(cache) == (8, 0)
    cache.check_integrity()
    # Keys diverging inside the first page share nothing (children keyed by the whole page).
    other = toks[:3] + [7, 7, 7, 7, 7]
    assert cache.insert(RadixKey(other), alloc.alloc(8)) == 0
    assert len(cache.root.children) == 2
    assert sizes(cache) == (16, 0)
    # insert of a key sharing 6 tokens: 4 already present, a partial page never cached.
    new = alloc.alloc(8)
    assert new == list(range(24, 32))
    assert cache.insert(RadixKey(toks[:6] + [1, 1, 1]), new) == 4
    alloc.free(new[:4])
    assert sizes(cache) == (20, 0)  # one more page: tokens 4..7 of the key (the 9th is cut)
    assert cache.match_prefix(RadixKey(toks[:6] + [1, 1, 1])).device_indices.tolist() == [4, 5, 6, 7, 28, 29, 30, 31]
    for node in [cache.root]:
        stack = [node]
        while stack:
            n = stack.pop()
            assert len(n.key) % 4 == 0
            stack.extend(n.children.values())
    check_accounting(cache, alloc)
    assert cache.evict(100) == 20
    check_accounting(cache, alloc)
    assert alloc.available_size() == 32


# --- namespaces ------------------------------------------------------------------------------


def test_extra_key_namespaces_never_share_nodes() -> None:
    cache, alloc = make()
    a = put(cache, alloc, [1, 2, 3])
    b = put(cache, alloc, [1, 2, 3], extra_key="lora-a")
    c = put(cache, alloc, [1, 2, 4], extra_key="lora-b")
    assert (a, b, c) == ([1, 2, 3], [4, 5, 6], [7, 8, 9])
    assert sizes(cache) == (9, 0)
    assert len(cache.root.children) == 3
    assert cache.match_prefix(RadixKey([1, 2, 3])).device_indices.tolist() == [1, 2, 3]
    assert cache.match_prefix(RadixKey([1, 2, 3], "lora-a")).device_indices.tolist() == [4, 5, 6]
    assert cache.match_prefix(RadixKey([1, 2, 3], "lora-b")).device_indices.tolist() == [7, 8]
    assert cache.match_prefix(RadixKey([1, 2, 3], "other")).device_indices.tolist() == []
    # A split inside one namespace leaves the others alone.
    assert put(cache, alloc, [1, 2, 9], extra_key="lora-a") == [10, 11, 12]  # 10, 11 freed as dups
    assert cache.match_prefix(RadixKey([1, 2, 9], "lora-a")).device_indices.tolist() == [4, 5, 12]
    assert cache.match_prefix(RadixKey([1, 2, 3])).last_node.key == [1, 2, 3]
    n = cache.match_prefix(RadixKey([1, 2], "lora-a")).last_node
    assert n.extra_key == "lora-a" and n.key == [1, 2] and len(n.children) == 2
    check_accounting(cache, alloc)


# --- integrity -------------------------------------------------------------------------------


def test_check_integrity_detects_corruption() -> None:
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3])
    put(cache, alloc, [1, 2, 4])
    cache.check_integrity()
    cache._evictable += 1
    with pytest.raises(AssertionError, match="sizes drifted"):
        cache.check_integrity()
    cache._evictable -= 1
    cache._protected += 2
    with pytest.raises(AssertionError, match="sizes drifted"):
        cache.check_integrity()
    cache._protected -= 2
    leaf = node_of(cache, [1, 2, 3])
    cache._leaves.discard(leaf)
    with pytest.raises(AssertionError, match="leaf set"):
        cache.check_integrity()
    cache._leaves.add(leaf)
    leaf.value.append(99)
    with pytest.raises(AssertionError, match="lengths"):
        cache.check_integrity()
    leaf.value.pop()
    leaf.lock_ref = 1  # locked more than its parent, and sizes no longer agree
    with pytest.raises(AssertionError):
        cache.check_integrity()
    leaf.lock_ref = 0
    cache.check_integrity()
