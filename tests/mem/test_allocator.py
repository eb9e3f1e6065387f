"""``TokenToKVPoolAllocator``: exact slot ids, exact sizes, page 0 never handed out."""

from __future__ import annotations

import random
from array import array

import pytest

from radixserve.mem.allocator import SMALL_FREE, OutOfKVSlots, TokenToKVPoolAllocator


def free_slots(a: TokenToKVPoolAllocator) -> set[int]:
    """Every slot the allocator would hand out now (derived from its per-page free flags)."""
    ps = a.page_size
    return {p * ps + o for p in range(1, a.num_pages + 1) if a._is_free[p] for o in range(ps)}


def test_construction_rejects_bad_sizes() -> None:
    for size, ps in [(0, 1), (-4, 1), (10, 4), (8, 0)]:
        with pytest.raises(ValueError):
            TokenToKVPoolAllocator(size, ps)


def test_page1_smallest_first_and_padding_slot_never_handed_out() -> None:
    a = TokenToKVPoolAllocator(8, 1)
    assert a.available_size() == 8
    assert free_slots(a) == set(range(1, 9))  # slot 0 is the padding page
    assert a.alloc(3) == [1, 2, 3]
    assert a.alloc(1) == [4]
    assert a.available_size() == 4
    assert a.alloc(4) == [5, 6, 7, 8]
    assert a.available_size() == 0
    with pytest.raises(OutOfKVSlots):
        a.alloc(1)
    assert a.available_size() == 0  # a failed alloc takes nothing
    assert a.alloc(0) == []


def test_free_returns_exactly_what_was_taken() -> None:
    a = TokenToKVPoolAllocator(8, 1)
    s = a.alloc(5)
    assert s == [1, 2, 3, 4, 5]
    a.free([2, 4])
    assert a.available_size() == 5
    assert free_slots(a) == {2, 4, 6, 7, 8}
    # Freed pages wait in the released list; the untouched free pages go first (SGLang's lazy merge).
    assert a.alloc(2) == [6, 7]
    # Now only 1 never-used page is left: the released ones are merged and the smallest go first.
    assert a.alloc(3) == [2, 4, 8]
    assert a.available_size() == 0
    a.free([1, 2, 3, 4, 5, 6, 7, 8])
    assert a.available_size() == 8
    assert free_slots(a) == set(range(1, 9))
    a.free([])  # a no-op
    assert a.available_size() == 8


def test_clear_restores_the_fresh_state() -> None:
    a = TokenToKVPoolAllocator(8, 2)
    a.alloc(4)
    a.clear()
    assert a.available_size() == 8
    assert a.alloc(2) == [2, 3]


def test_double_free_and_foreign_slots_raise() -> None:
    a = TokenToKVPoolAllocator(8, 1)
    s = a.alloc(2)
    a.free(s)
    with pytest.raises(RuntimeError, match="freed twice"):
        a.free([s[0]])
    with pytest.raises(RuntimeError, match="freed twice"):
        a.free([3])  # never handed out
    with pytest.raises(RuntimeError, match="not in this pool"):
        a.free([0])  # the padding slot
    with pytest.raises(RuntimeError, match="not in this pool"):
        a.free([9])
    a.alloc(8)
    with pytest.raises(RuntimeError, match="freed twice"):
        a.free([5, 5])  # the same slot twice in one call


def test_paged_alloc_whole_pages_and_padding_page() -> None:
    a = TokenToKVPoolAllocator(16, 4)  # pages 1..4 = slots 4..19; page 0 = slots 0..3 never
    assert a.num_pages == 4
    assert free_slots(a) == set(range(4, 20))
    assert a.alloc(4) == [4, 5, 6, 7]
    assert a.alloc(8) == [8, 9, 10, 11, 12, 13, 14, 15]
    assert a.available_size() == 4
    for bad in (1, 2, 3, 5, 6):
        with pytest.raises(ValueError, match="page aligned"):
            a.alloc(bad)
    assert a.available_size() == 4
    with pytest.raises(OutOfKVSlots):
        a.alloc(8)
    # Freeing any slot of a page frees the whole page (callers free whole pages only).
    a.free([9])
    assert a.available_size() == 8
    assert free_slots(a) == set(range(8, 12)) | set(range(16, 20))
    with pytest.raises(RuntimeError, match="freed twice"):
        a.free([10])  # same page again
    assert a.alloc(8) == [8, 9, 10, 11, 16, 17, 18, 19]
    assert a.available_size() == 0


def test_pages_needed() -> None:
    a = TokenToKVPoolAllocator(64, 4)
    assert a.pages_needed(0, 0) == 0
    assert a.pages_needed(0, 1) == 1
    assert a.pages_needed(0, 4) == 1
    assert a.pages_needed(0, 5) == 2
    assert a.pages_needed(3, 1) == 0  # fits in the partly used page
    assert a.pages_needed(3, 2) == 1
    assert a.pages_needed(4, 1) == 1
    assert a.pages_needed(3, 6) == 2  # 1 in page 0, 5 more -> 2 pages
    assert a.pages_needed(8, 8) == 2
    b = TokenToKVPoolAllocator(64, 1)
    assert [b.pages_needed(5, n) for n in (0, 1, 7)] == [0, 1, 7]


def test_alloc_extend_fills_partial_page_then_fresh_pages() -> None:
    a = TokenToKVPoolAllocator(32, 4)  # pages 1..8 = slots 4..35
    first = a.alloc_extend(None, 0, 3)  # a new request: 3 tokens in one fresh page
    assert first == [4, 5, 6]
    assert a.available_size() == 28
    other = a.alloc_extend(None, 0, 4)  # another request takes page 2
    assert other == [8, 9, 10, 11]
    # 6 more tokens for the first request: 1 fills its page (slot 7), 5 take pages 3 and 4.
    more = a.alloc_extend(first[-1], 3, 6)
    assert more == [7, 12, 13, 14, 15, 16]
    assert a.available_size() == 16
    # Decode within the partly used page needs no new page.
    assert a.alloc_extend(16, 9, 1) == [17]
    assert a.available_size() == 16
    assert a.alloc_extend(17, 10, 2) == [18, 19]
    assert a.available_size() == 16
    # An aligned length starts a fresh page.
    assert a.alloc_extend(19, 12, 1) == [20]
    assert a.available_size() == 12
    # New tokens that all fit into the partial page.
    assert a.alloc_extend(20, 13, 3) == [21, 22, 23]
    assert a.available_size() == 12
    with pytest.raises(ValueError, match="last_slot"):
        a.alloc_extend(None, 5, 1)
    with pytest.raises(OutOfKVSlots):
        a.alloc_extend(23, 16, 13)  # 4 pages needed, 3 free
    assert a.available_size() == 12


def test_alloc_extend_page1() -> None:
    a = TokenToKVPoolAllocator(8, 1)
    assert a.alloc_extend(None, 0, 3) == [1, 2, 3]
    assert a.alloc_extend(3, 3, 2) == [4, 5]
    assert a.alloc_extend(5, 5, 0) == []
    assert a.available_size() == 3


@pytest.mark.parametrize("page_size", [1, 2, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_alloc_free_never_hands_a_slot_out_twice(page_size: int, seed: int) -> None:
    rng = random.Random(seed)
    num_pages = 24
    a = TokenToKVPoolAllocator(num_pages * page_size, page_size)
    padding = set(range(page_size))
    owners: dict[int, list[int]] = {}  # request id -> its token slots, in order
    live: set[int] = set()  # slots of pages that requests hold
    next_id = 0

    def live_pages() -> set[int]:
        return {s // page_size for s in live}

    for _ in range(600):
        op = rng.random()
        if op < 0.35 or not owners:  # a new request
            n = rng.randint(1, 3 * page_size)
            need = a.pages_needed(0, n)
            if need > a.available_size() // page_size:
                with pytest.raises(OutOfKVSlots):
                    a.alloc_extend(None, 0, n)
                continue
            slots = a.alloc_extend(None, 0, n)
            assert len(slots) == n
            assert not (set(slots) & live), "a slot was handed out twice"
            assert not (set(slots) & padding)
            owners[next_id] = slots
            next_id += 1
            live.update(p * page_size + o for p in {s // page_size for s in slots} for o in range(page_size))
        elif op < 0.7:  # an existing request grows
            rid = rng.choice(sorted(owners))
            cur = owners[rid]
            n = rng.randint(1, 2 * page_size)
            need = a.pages_needed(len(cur), n)
            if need > a.available_size() // page_size:
                continue
            before = a.available_size()
            slots = a.alloc_extend(cur[-1], len(cur), n)
            assert a.available_size() == before - need * page_size
            assert len(slots) == n == len(set(slots))
            own_pages = {s // page_size for s in cur}
            fresh = [s for s in slots if s // page_size not in own_pages]
            in_own = [s for s in slots if s // page_size in own_pages]
            assert in_own == slots[: len(in_own)], "the partial page is filled first"
            assert not (set(fresh) & live), "a slot was handed out twice"
            assert not (set(in_own) & set(cur))
            cur.extend(slots)
            live.update(p * page_size + o for p in {s // page_size for s in slots} for o in range(page_size))
        elif op < 0.75 and owners:  # a double free is caught
            rid = rng.choice(sorted(owners))
            slots = owners.pop(rid)
            a.free(slots)
            live -= {p * page_size + o for p in {s // page_size for s in slots} for o in range(page_size)}
            with pytest.raises(RuntimeError):
                a.free(slots[:1])
        else:  # a request ends
            rid = rng.choice(sorted(owners))
            slots = owners.pop(rid)
            a.free(slots)
            live -= {p * page_size + o for p in {s // page_size for s in slots} for o in range(page_size)}
        # Exact bookkeeping after every operation.
        assert a.available_size() == (num_pages - len(live_pages())) * page_size
        assert free_slots(a) == set(range(page_size, (num_pages + 1) * page_size)) - live
        all_owned = [s for v in owners.values() for s in v]
        assert len(all_owned) == len(set(all_owned))
    for slots in owners.values():
        a.free(slots)
    assert a.available_size() == num_pages * page_size


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("as_array", [False, True])
def test_a_bulk_free_does_what_slot_by_slot_frees_do(page_size: int, as_array: bool) -> None:
    """Frees of at least ``SMALL_FREE`` slots take the array path: the same pages come back, in the
    same order of reuse, as when the same slots are freed a few at a time."""
    rng = random.Random(page_size)
    bulk, small = TokenToKVPoolAllocator(4096, page_size), TokenToKVPoolAllocator(4096, page_size)
    held_bulk, held_small = bulk.alloc(4096), small.alloc(4096)
    assert held_bulk == held_small
    pages = list(range(1, 4096 // page_size + 1))
    rng.shuffle(pages)
    give = [p * page_size + o for p in pages[:300] for o in range(page_size)]
    bulk.free(array("q", give) if as_array else give)
    for i in range(0, len(give), 4 * page_size):
        small.free(give[i:i + 4 * page_size])
    assert bulk.available_size() == small.available_size() == 300 * page_size
    assert free_slots(bulk) == free_slots(small) == set(give)
    assert bulk.alloc(64 * page_size) == small.alloc(64 * page_size)  # smallest ids first, both
    assert free_slots(bulk) == free_slots(small)


def test_a_bulk_free_refuses_what_a_small_one_refuses() -> None:
    a = TokenToKVPoolAllocator(1024, 1)
    held = a.alloc(512)
    a.free(array("q", held[:SMALL_FREE]))
    with pytest.raises(RuntimeError, match="freed twice"):
        a.free(array("q", held[: 2 * SMALL_FREE]))  # the first half is free already
    with pytest.raises(RuntimeError, match="not in this pool"):
        a.free(array("q", [*held[SMALL_FREE: 2 * SMALL_FREE], 5000]))
    with pytest.raises(RuntimeError, match="not in this pool"):
        a.free([0] * SMALL_FREE)  # the padding page
    assert a.available_size() == 1024 - 512 + SMALL_FREE  # a refused free changes nothing
