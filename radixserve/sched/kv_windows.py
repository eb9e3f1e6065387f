"""``Windows``: the KV that sliding windows let ``KVManager`` give back before a request ends.

A model whose every layer attends over a sliding window (``window``: Mistral 7B v0.1 and Phi-3-mini
past their window) never reads a request's KV more than ``window`` positions behind its newest
token. As a request grows, its own slots that far behind are freed, whole pages, one position later
than strictly needed (a step still in flight in the overlap loop reads its own window). The cached
prefix (the prompt, shared) is not touched: it stays for the prefix hits of later requests. When
the request ends, only the KV before the freed span is whole: that part goes to the cache as
usual, the rest is freed (a later request reuses the prompt, not this request's output).

A model with sliding-window layers among global ones (``window_kv``: Gemma 2 and 3) keeps the
sliding layers' KV at slots of their own (mem/window_kv.py). Every position stays for the global
layers; the sliding layers' pages are given back, the same way, as a request's own KV falls more
than a window behind it, and when KV goes to the prefix cache, for all but the last window (and a
page) before where it ends. ``KVManager.match`` matches a cached prefix only as far as the window
before its end is whole.
"""

from __future__ import annotations

from collections.abc import Callable

from radixserve.mem.allocator import TokenToKVPoolAllocator
from radixserve.mem.window_kv import WindowKV
from radixserve.sched.req import Req


class Windows:
    def __init__(self, allocator: TokenToKVPoolAllocator, window: int | None, window_kv: WindowKV | None) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.window = window  # a whole-model sliding window: own slots behind it are freed
        self.window_kv = window_kv  # the sliding layers' own pages, beside global layers

    def _behind(self, req: Req, window: int, done: int) -> tuple[int, int]:
        """The span of ``req``'s own positions, from ``done`` on, more than ``window`` behind its
        next token, whole pages."""
        return max(done, req.cache_protected_len), (len(req.kv_indices) - window) // self.page_size * self.page_size

    def before_grow(self, req: Req) -> None:
        """``req`` grows: free its own slots behind a whole-model window (its kv_indices keep their
        stale entries until ``whole_prefix``), give back its sliding layers' pages behind theirs."""
        if self.window is not None:
            start, end = self._behind(req, self.window, req.kv_freed_to)
            if end > start:
                self.allocator.free(req.kv_indices[start:end])
                req.kv_freed_to = end
        if self.window_kv is not None:
            start, end = self._behind(req, self.window_kv.window, req.window_dropped_to)
            if end > start:
                self.window_kv.drop(req.kv_indices[start:end])
                req.window_dropped_to = end

    def whole_prefix(self, req: Req) -> None:
        """Before ``req``'s KV is cached or freed: with slots freed behind a window, cut its KV back
        to the part before them (freeing the slots after them)."""
        a, b = req.cache_protected_len, req.kv_freed_to
        if b > a:
            self.allocator.free(req.kv_indices[b:])
            del req.kv_indices[a:]
        req.kv_freed_to = 0

    def cache(self, req: Req, hand: Callable[[Req], None]) -> None:
        """``hand(req)`` gives ``req``'s KV to the prefix cache; then the sliding layers' pages of
        what it gave more than a window and a page before its end come back (the page keeps the same
        prompt again, matched up to its last token but one, whole). Only its own slots: where the
        cache had the tokens already, its slots were freed (a no-op here) and the cache's, which
        other requests may be reading, are left alone."""
        wkv = self.window_kv
        if wkv is None:
            hand(req)
            return
        start, own, end = req.cache_protected_len, req.kv_indices[req.cache_protected_len :], len(req.kv_indices)
        lo = max(start, req.window_dropped_to)
        hand(req)
        hi = (end - wkv.window - self.page_size) // self.page_size * self.page_size
        if hi > lo:
            wkv.drop(own[lo - start : hi - start])
