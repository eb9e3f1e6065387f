"""``LeafHeap``: the radix cache's evictable leaves in eviction order, kept across ``evict`` calls.

Rebuilding a heap of every evictable leaf on each ``evict`` call costs O(leaves), and the
allocator evicts whenever its free list runs short (once the pool is full of cached prefixes, on
nearly every decode step). This heap lives as long as the tree and uses lazy deletion:

- an entry is ``(priority, node, stamp)``; pushing a node bumps ``node.heap_stamp``, so only its
  latest entry is live, and an entry whose node is no longer an evictable leaf is skipped;
- a node is pushed when it becomes an evictable leaf (inserted, unlocked, or its last child went).

Priorities may change while a leaf waits (``match_prefix`` refreshes access times and hit
counts). For a strategy that declares ``monotone = True`` (its priorities never decrease, except
when it bumps its ``epoch``), an entry's stored priority is a lower bound of the real one, so a
popped entry whose priority moved is pushed back with the new value and the first entry popped
with an unchanged priority is the true minimum: exactly the leaf a fresh heap would give. When
``epoch`` changes (e.g. ``QueueAwareStrategy`` dropped nodes from its wanted set, which lowers
their priority) the heap is rebuilt once. A strategy without ``monotone`` gets a fresh heap on
every ``evict`` call, as before (exact for any priority function).

Ties: entries compare by priority, then by node (``TreeNode.__lt__``: creation id), the same as a
fresh ``heapify`` of ``(priority, node)`` pairs.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from typing import Any


class LeafHeap:
    def __init__(self, strategy: Any, leaves: set[Any]) -> None:
        self.strategy = strategy
        self.leaves = leaves  # the cache's set of evictable leaves (shared, not copied)
        self.monotone = bool(getattr(strategy, "monotone", False))
        self._heap: list[tuple[Any, Any, int]] = []
        self._epoch = getattr(strategy, "epoch", 0)

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, node: Any) -> None:
        """``node`` just became an evictable leaf."""
        node.heap_stamp += 1
        heap = self._heap
        heapq.heappush(heap, (self.strategy.priority(node), node, node.heap_stamp))
        if len(heap) > 2 * len(self.leaves) + 64:  # mostly dead entries: compact
            self.rebuild()

    def rebuild(self) -> None:
        prio = self.strategy.priority
        heap = []
        for n in self.leaves:
            n.heap_stamp += 1
            heap.append((prio(n), n, n.heap_stamp))
        heapq.heapify(heap)
        self._heap = heap
        self._epoch = getattr(self.strategy, "epoch", 0)

    def pop_order(self) -> Iterator[Any]:
        """Evictable leaves, smallest priority first; the caller evicts each one it takes before
        asking for the next (a parent that becomes a leaf meanwhile is pushed by the cache)."""
        if not self.monotone or getattr(self.strategy, "epoch", 0) != self._epoch:
            self.rebuild()
        leaves = self.leaves
        prio: Callable[[Any], Any] = self.strategy.priority
        pop = heapq.heappop
        while self._heap:
            heap = self._heap  # read again each time: a push while the caller evicts may compact it
            p, node, stamp = heap[0]
            if stamp != node.heap_stamp or node not in leaves:
                pop(heap)  # dead: pushed again since, or no longer an evictable leaf
                continue
            cur = prio(node)
            if cur != p:  # touched since it was pushed: its place moved back
                node.heap_stamp += 1
                heapq.heapreplace(heap, (cur, node, node.heap_stamp))
                continue
            pop(heap)
            yield node

    def check(self) -> None:
        """Raise if some evictable leaf has no live entry, or (monotone) one whose stored priority
        is above its real one (it would be evicted too late)."""
        live = {}
        for p, node, stamp in self._heap:
            if stamp == node.heap_stamp and node in self.leaves:
                live[node] = p
        missing = [n for n in self.leaves if n not in live]
        if missing:
            raise AssertionError(f"evictable leaves missing from the eviction heap: {missing[:3]}")
        if self.monotone and getattr(self.strategy, "epoch", 0) == self._epoch:
            prio = self.strategy.priority
            late = [n for n, p in live.items() if prio(n) < p]
            if late:
                raise AssertionError(f"eviction heap entries above their priority: {late[:3]}")
