"""``WindowKV``: the sliding-window layers' own KV slots, for a model that mixes them with global
layers (Gemma 2 and 3: most layers see the last ``window`` positions, a few see everything).

With one slot per token for every layer, a sliding layer's K/V would stay as long as the global
layers' (a request's whole past, the prefix cache's every token), though it is read only within a
window. So the sliding layers keep K/V at slots of their own: every page the main allocator hands
out gets a page here (``page_of[main page]``; 0: none), given back with the main page (a request
frees it, the cache evicts it) or earlier, the main page kept, once no sliding layer can read it:
- a running request's own pages more than a window behind its newest token (``KVManager``);
- the pages of KV handed to the prefix cache more than a window before the end of what was handed
  (a later request whose cached prefix ends there reads only the window before that end).

::

    main slots    | p1 | p2 | p3 | p4 | p5 |     global layers: every position
    page_of       |  0 |  0 |  7 |  2 |  5 |     sliding layers: the window's pages only

``ReqToTokenPool`` keeps a twin of its table in window slots (its ``window`` pool), written through
``page_of`` with every write to the main one; the sliding layers' attention reads it, and writes a
forward's new K/V at ``translate(out_cache_loc)``. A cached prefix serves a later request only up
to a point whose window before it still has its pages (``usable_prefix``): a prefix hit stops there.

There are as many pages here as in the main pool, so these never run out first (a main page has at
most one), and the sliding layers' buffers in the KV pool are as large as the others'. What this
saves is memory actually touched: a buffer's pages are backed on their first write (kv_pool.py),
and the smallest free page is always handed out first (a heap), so the pages in use stay packed at
the start of the sliding layers' buffers, about a window per request plus the cached windows.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Sequence

import numpy as np
import torch


class WindowKV:
    def __init__(self, num_pages: int, page_size: int, window: int) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.window = window
        self.page_of = torch.zeros(num_pages + 1, dtype=torch.int64)  # main page -> window page (0: none)
        self._map = self.page_of.numpy()  # the same memory, for the scheduler's updates
        self.clear()

    def clear(self) -> None:
        self._map[:] = 0
        self._free = list(range(1, self.num_pages + 1))  # a heap (sorted already): smallest page first
        self._used = 0

    def used_pages(self) -> int:
        return self._used

    # --- the main allocator's pages come and go ------------------------------------------------------
    def take(self, pages: Sequence[int]) -> None:
        """Fresh main ``pages`` get fresh window pages."""
        if len(pages) > len(self._free):  # (never: a main page holds at most one)
            raise RuntimeError(f"window KV: {len(pages)} pages asked for, {len(self._free)} free")
        pop, m = heapq.heappop, self._map
        for p in pages:
            m[p] = pop(self._free)
        self._used += len(pages)

    def release(self, pages: Sequence[int] | np.ndarray) -> None:
        """Main ``pages`` go back to the main allocator: their window pages, where they still have
        them, come back here."""
        idx = np.asarray(pages, dtype=np.int64)
        if not len(idx):
            return
        own = self._map[idx]
        held = own[own != 0]
        if len(held) == 0:
            return
        self._map[idx] = 0
        push, free = heapq.heappush, self._free
        for w in held.tolist():
            push(free, w)
        self._used -= len(held)

    def drop(self, slots: Sequence[int] | array[int]) -> None:
        """Give back the window pages of ``slots``' pages (whole pages, the main ones kept): no
        sliding layer reads them again."""
        if not len(slots):
            return
        idx = np.frombuffer(slots, dtype=np.int64) if isinstance(slots, array) else np.asarray(slots, dtype=np.int64)
        self.release(np.unique(idx // self.page_size) if self.page_size > 1 else idx)

    def adopt(self, cached: Sequence[int] | array[int], own: Sequence[int] | array[int]) -> None:
        """The prefix cache has the tokens that ``own`` slots hold (the same tokens at the same
        positions, inserted by someone else) and ``own`` is about to be freed: where a page of the
        ``cached`` slots has no window page and the matching ``own`` page has one, it moves over
        (the KV in it is that of the same tokens): the window of whoever goes on from there is whole."""
        ps = self.page_size
        c = np.asarray(cached, dtype=np.int64)[::ps] // ps
        o = np.asarray(own, dtype=np.int64)[::ps] // ps
        m = self._map
        move = (m[c] == 0) & (m[o] != 0) & (c != o)
        if move.any():
            m[c[move]] = m[o[move]]
            m[o[move]] = 0

    # --- what the model and the prefix cache ask --------------------------------------------------------
    def translate(self, slots: torch.Tensor) -> torch.Tensor:
        """The window slots of main ``slots`` (int64, any shape): the slot at the same offset in the
        page's window page; the padding page's slots for a page without one."""
        ps = self.page_size
        page_of = self.page_of if slots.device == self.page_of.device else self.page_of.to(slots.device)
        if ps == 1:
            return page_of[slots]
        return page_of[slots // ps] * ps + slots % ps

    def usable_prefix(self, slots: Sequence[int] | array[int]) -> int:
        """The longest whole-page prefix of a cached prefix (its main ``slots``) whose last ``window``
        positions (all of them, when shorter) still have their window pages."""
        n = len(slots)
        if not n:
            return 0
        ps = self.page_size
        idx = np.frombuffer(slots, dtype=np.int64) if isinstance(slots, array) else np.asarray(slots, dtype=np.int64)
        missing = np.flatnonzero(self._map[idx // ps] == 0)
        end = n
        while len(missing):
            # the last position without a window page before ``end``; the prefix either ends at or
            # before it, or more than a window after it
            k = int(np.searchsorted(missing, end)) - 1
            if k < 0 or int(missing[k]) < end - self.window:
                break
            end = int(missing[k]) // ps * ps
        return end

    def check(self, handed_out: np.ndarray) -> None:
        """Raise unless the window pages in use are exactly the distinct ones of main pages that are
        handed out (``handed_out``: a flag per main page)."""
        held = np.flatnonzero(self._map)
        if len(held) != self._used or len(held) + len(self._free) != self.num_pages:
            raise AssertionError(f"window KV: {len(held)} pages mapped, {self._used} counted used, "
                                 f"{len(self._free)} free of {self.num_pages}")
        if len(np.unique(self._map[held])) != len(held):
            raise AssertionError("window KV: a window page is mapped by two main pages")
        if not handed_out[held].all():
            raise AssertionError("window KV: a free main page still has a window page")
