"""``WindowKV`` alone: window pages follow the main allocator's, come back early when dropped, move
to cached slots that lack them, and a cached prefix is usable only as far as its window is whole."""

from __future__ import annotations

from array import array

import numpy as np
import pytest
import torch

from radixserve.mem.allocator import TokenToKVPoolAllocator
from radixserve.mem.kv_pool import KVPool, resident_bytes
from radixserve.mem.window_kv import WindowKV


def _pair(pages: int, page: int, window: int) -> tuple[TokenToKVPoolAllocator, WindowKV]:
    alloc = TokenToKVPoolAllocator(pages * page, page)
    wkv = WindowKV(pages, page, window)
    alloc.attach_window_kv(wkv)
    return alloc, wkv


@pytest.mark.parametrize("page", [1, 4])
def test_window_pages_follow_the_main_pages_and_come_back_early(page: int) -> None:
    alloc, wkv = _pair(32, page, 8)
    a = alloc.alloc(8 * page)
    b = alloc.alloc(4 * page)
    assert wkv.used_pages() == 12
    wkv.check(alloc.handed_out_pages())
    # each main slot's window slot sits at its offset in a distinct window page
    w = wkv.translate(torch.tensor(a + b)).tolist()
    assert len(set(w)) == len(w) and min(w) >= page and [s % page for s in w] == [s % page for s in a + b]
    wkv.drop(a[: 3 * page])  # the main slots stay handed out
    assert wkv.used_pages() == 9 and all(alloc.is_handed_out(s) for s in a)
    assert wkv.translate(torch.tensor(a[:page])).tolist() == list(range(page))  # the padding page
    wkv.drop(a[: 3 * page])  # again: nothing left to give back
    assert wkv.used_pages() == 9
    alloc.free(a)  # the main pages: their window pages, where they have them, come back too
    assert wkv.used_pages() == 4
    wkv.check(alloc.handed_out_pages())
    c = alloc.alloc(2 * page)  # the smallest window pages go out first: those just given back
    assert sorted(set(s // page for s in wkv.translate(torch.tensor(c)).tolist())) == [1, 2]
    alloc.free(b + c)
    assert wkv.used_pages() == 0
    wkv.check(alloc.handed_out_pages())


def test_a_cached_prefix_is_usable_as_far_as_its_window_is_whole() -> None:
    alloc, wkv = _pair(64, 1, 8)
    slots = alloc.alloc(40)
    assert wkv.usable_prefix(array("q", slots)) == 40
    wkv.drop(slots[:20])  # positions 0..19 lost their window pages
    assert wkv.usable_prefix(array("q", slots)) == 40  # the window before 40 (32..39) is whole
    assert wkv.usable_prefix(array("q", slots[:28])) == 28  # (20..27)
    assert wkv.usable_prefix(array("q", slots[:25])) == 0  # its window reaches 19; nothing before 20 is whole
    wkv.drop(slots[30:31])  # a hole at 30
    assert wkv.usable_prefix(array("q", slots)) == 40  # 32..39 still whole
    assert wkv.usable_prefix(array("q", slots[:36])) == 30  # 28..35 holds the hole: back to 30 (22..29)
    assert wkv.usable_prefix(array("q", [])) == 0


def test_paged_prefixes_end_on_pages() -> None:
    alloc, wkv = _pair(16, 4, 8)
    slots = alloc.alloc(40)
    wkv.drop(slots[16:20])  # page 4 of the prefix
    assert wkv.usable_prefix(slots[:24]) == 16  # the window before 24 reaches page 4: back to 16
    assert wkv.usable_prefix(slots[:32]) == 32


def test_a_duplicate_hands_its_window_pages_to_cached_slots_that_lack_them() -> None:
    alloc, wkv = _pair(32, 1, 8)
    cached, own = alloc.alloc(6), alloc.alloc(6)
    wkv.drop(cached[:4])
    before = wkv.translate(torch.tensor(own)).tolist()
    wkv.adopt(array("q", cached), own)
    after = wkv.translate(torch.tensor(cached)).tolist()
    assert after[:4] == before[:4]  # moved over
    assert wkv.used_pages() == 8
    alloc.free(own)  # the duplicates go; the moved pages stay with the cached slots
    assert wkv.used_pages() == 6 and wkv.translate(torch.tensor(cached)).tolist()[:4] == before[:4]
    wkv.check(alloc.handed_out_pages())


def test_a_mismatched_window_kv_is_refused() -> None:
    with pytest.raises(ValueError, match="main pool's pages"):
        TokenToKVPoolAllocator(64, 4).attach_window_kv(WindowKV(8, 4, 8))


def test_resident_bytes_counts_what_writes_touched() -> None:
    pool = KVPool(16384, 1, 2, 2, 64, torch.float32)
    assert pool.resident_bytes()[0] == 0  # mapped, never written
    pool.write(1, torch.arange(1, 1025), torch.ones(1024, 2, 64), torch.ones(1024, 2, 64))
    touched, mapped = pool.resident_bytes()
    assert mapped == 4 * 16385 * 2 * 64 * 4
    assert 2 * 1024 * 2 * 64 * 4 <= touched < mapped / 2
    assert pool.resident_bytes([0])[0] == 0 and resident_bytes(torch.empty(0)) == 0
    assert np.isclose(pool.resident_bytes([1])[0], touched)
