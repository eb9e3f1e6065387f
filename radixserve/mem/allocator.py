"""``TokenToKVPoolAllocator``: hands out KV slot indices, a page at a time.

The pool has ``size`` usable slots in ``size // page_size`` pages; page 0 (slots
``0 .. page_size-1``) is the reserved padding page and is never handed out, so usable pages are
``1 .. num_pages``. A request owns whole pages: its token ``i`` lives in its
``i // page_size``-th page at offset ``i % page_size``, which is what lets the radix cache share
page-aligned prefixes.

    slots  | pad page | page 1 | page 2 | ... | page N |
           |  never   |   free pages are kept in a stack, smallest id on top   |

Exact accounting: every slot is either free here, held by a request, or held by the cache.

A model with sliding-window layers among global ones has the window KV's pages follow these
(``window_kv``, mem/window_kv.py): each page taken here takes one there, each page freed here
frees its one there.

Freeing is bulk: a large free (an eviction's slots, one int64 ``array`` from the radix cache, read
in place) checks and marks its pages with array operations and is kept as one block until the free
stack runs dry; only a small free (a request's last few slots) takes the per-slot loop.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from radixserve.mem.window_kv import WindowKV

SMALL_FREE = 64  # slots; fewer are freed one by one (an array's set-up costs more than the loop)


class OutOfKVSlots(RuntimeError):
    pass


class TokenToKVPoolAllocator:
    def __init__(self, size: int, page_size: int = 1) -> None:
        if size <= 0 or page_size <= 0 or size % page_size:
            raise ValueError(f"pool size {size} must be a positive multiple of page_size {page_size}")
        self.size = size
        self.page_size = page_size
        self.num_pages = size // page_size
        self.window_kv: WindowKV | None = None  # the sliding-window layers' slots, which follow these
        self.clear()

    def attach_window_kv(self, window_kv: WindowKV) -> None:
        if window_kv.num_pages != self.num_pages or window_kv.page_size != self.page_size:
            raise ValueError("the window KV must have the main pool's pages")
        self.window_kv = window_kv

    def clear(self) -> None:
        if self.window_kv is not None:
            self.window_kv.clear()
        # Descending, so pop() from the end hands out the smallest page id first (deterministic).
        self._free_pages: list[int] = list(range(self.num_pages, 0, -1))
        self._released: list[int] = []  # freed one by one since the stack was last refilled
        self._released_blocks: list[np.ndarray] = []  # freed in bulk since then, one block per call
        self._n_released = 0  # pages in both
        self._is_free = bytearray(b"\x01") * (self.num_pages + 1)
        self._is_free[0] = 0
        self._is_free_view = np.frombuffer(self._is_free, dtype=np.uint8)  # the same bytes, for bulk frees

    def available_size(self) -> int:
        return (len(self._free_pages) + self._n_released) * self.page_size

    def _refill(self) -> None:
        """Move every released page onto the free stack, kept sorted so the smallest id goes first."""
        free = self._free_pages
        free.extend(self._released)
        for block in self._released_blocks:
            free.extend(block.tolist())
        self._released = []
        self._released_blocks = []
        self._n_released = 0
        free.sort(reverse=True)

    def handed_out_pages(self) -> np.ndarray:
        """A flag per page id (0 .. num_pages): whether it is allocated (the padding page's is 0)."""
        out = self._is_free_view == 0
        out[0] = False
        return out

    def is_handed_out(self, slot: int) -> bool:
        """Whether ``slot``'s page is allocated (not free, not the padding page)."""
        page = slot // self.page_size
        return 0 < page <= self.num_pages and not self._is_free[page]

    def _take_pages(self, n: int) -> list[int]:
        if n > len(self._free_pages):
            if n > len(self._free_pages) + self._n_released:
                raise OutOfKVSlots(f"need {n} pages, {self.available_size() // self.page_size} free")
            self._refill()
        pages = self._free_pages[len(self._free_pages) - n :]
        del self._free_pages[len(self._free_pages) - n :]
        pages.reverse()
        for p in pages:
            self._is_free[p] = 0
        if self.window_kv is not None:
            self.window_kv.take(pages)
        return pages

    def take_pages_in_turn(self, n: int, evict: Callable[[int], int]) -> list[int]:
        """``n`` pages for ``n`` requests that each take one, in order: the same pages, and the same
        ``evict`` calls, as ``n`` calls of ``_take_pages(1)``, each preceded by ``evict(page_size)``
        when nothing at all is free (``KVManager.grow``'s rule), but in bulk."""
        free = self._free_pages
        out: list[int] = []
        while len(out) < n:
            if not free:
                if not self._n_released:
                    evict(self.page_size)
                    if not self._n_released:
                        raise OutOfKVSlots(f"need {n - len(out)} pages, 0 free")
                self._refill()
            k = min(n - len(out), len(free))
            chunk = free[len(free) - k :]
            del free[len(free) - k :]
            chunk.reverse()
            out.extend(chunk)
        is_free = self._is_free
        for p in out:
            is_free[p] = 0
        if self.window_kv is not None:
            self.window_kv.take(out)
        return out

    def alloc(self, need: int) -> list[int]:
        """``need`` fresh slots (a multiple of page_size when paged), whole pages, ascending."""
        if need % self.page_size:
            raise ValueError(f"alloc({need}) is not page aligned (page_size={self.page_size})")
        ps = self.page_size
        return [p * ps + o for p in self._take_pages(need // ps) for o in range(ps)]

    def pages_needed(self, cur_len: int, new_tokens: int) -> int:
        """Pages a request holding ``cur_len`` tokens needs to grow by ``new_tokens``."""
        ps = self.page_size
        return -(-(cur_len + new_tokens) // ps) - -(-cur_len // ps)

    def alloc_extend(self, last_slot: int | None, cur_len: int, new_tokens: int) -> list[int]:
        """Slots for tokens ``cur_len .. cur_len+new_tokens-1`` of one request.

        The first ones fill the request's last, partly used page (which holds ``last_slot``),
        the rest come from fresh pages::

            page k (owned)          fresh pages
            [x x x . ]  ->  [x x x n] [n n n n] [n . . .]
                   ^ last_slot
        """
        ps = self.page_size
        out: list[int] = []
        if ps > 1 and cur_len % ps:
            if last_slot is None:
                raise ValueError("a partly used page needs last_slot")
            room = min(ps - cur_len % ps, new_tokens)
            out.extend(range(last_slot + 1, last_slot + 1 + room))
        rest = new_tokens - len(out)
        if rest > 0:
            pages = self._take_pages(-(-rest // ps))
            slots = [p * ps + o for p in pages for o in range(ps)]
            out.extend(slots[:rest])
        return out

    def free(self, slots: Sequence[int] | array[int]) -> None:
        """Return the pages that ``slots`` lie in. The caller frees whole pages only."""
        n = len(slots)
        if not n:
            return
        if n >= SMALL_FREE:
            self._free_bulk(np.frombuffer(slots, dtype=np.int64) if isinstance(slots, array)
                            else np.fromiter(slots, dtype=np.int64, count=n))
            return
        ps = self.page_size
        pages = list(set(map(ps.__rfloordiv__, slots))) if ps > 1 else slots  # (C passes over the slots)
        is_free = self._is_free
        for p in pages:
            if p <= 0 or p > self.num_pages:
                raise RuntimeError(f"slot of page {p} is not in this pool")
            if is_free[p]:
                raise RuntimeError(f"page {p} freed twice")
            is_free[p] = 1
        if self.window_kv is not None:
            self.window_kv.release(pages)
        self._released.extend(pages)
        self._n_released += len(pages)

    def _free_bulk(self, slots: np.ndarray) -> None:
        """``free`` with array operations: the same checks, the same pages released. A page's slots
        lie next to each other in any request's or node's slot list, so its repeats are dropped by
        comparing neighbours (no sort). (A page given twice in one call, apart, is not caught here
        but by the memory invariant's count.)"""
        if self.page_size == 1:
            pages = slots
        else:
            pages = slots // self.page_size
            pages = pages[np.concatenate(([True], pages[1:] != pages[:-1]))]
        lo, hi = int(pages.min()), int(pages.max())
        if lo <= 0 or hi > self.num_pages:
            raise RuntimeError(f"slot of page {lo if lo <= 0 else hi} is not in this pool")
        flags = self._is_free_view
        taken = flags[pages]
        if taken.any():
            raise RuntimeError(f"page {int(pages[int(taken.argmax())])} freed twice")
        flags[pages] = 1
        if self.window_kv is not None:
            self.window_kv.release(pages)
        self._released_blocks.append(pages if pages is not slots else pages.copy())
        self._n_released += len(pages)
