"""Eviction order of unlocked radix leaves: a strategy is one method, ``priority(node)``; the
smallest priority is evicted first.

Optional, for speed (``radixserve.mem.leaf_heap``): ``monotone = True`` declares that a node's
priority never decreases as the tree touches it (access times and hit counts only grow), except
when the strategy bumps its integer ``epoch``. The cache then keeps one heap of leaves across
``evict`` calls instead of rebuilding it on each call. Without it, every call rebuilds."""

from __future__ import annotations

from typing import Any, Protocol


class EvictionStrategy(Protocol):
    def priority(self, node: Any) -> Any: ...


class LRUStrategy:
    """Least recently used first."""

    monotone = True  # last_access_time only grows

    def priority(self, node: Any) -> Any:
        return node.last_access_time


class LFUStrategy:
    """Least frequently hit first, least recently used among equals."""

    monotone = True  # hit_count and last_access_time only grow

    def priority(self, node: Any) -> Any:
        return (node.hit_count, node.last_access_time)


class QueueAwareStrategy:
    """Leaves no waiting request is about to reuse first (LRU among them), then the wanted ones (LRU).

    ``wanted`` holds the ids of the nodes on the cached paths of the waiting requests; the scheduler
    refreshes it before each prefill round (``radix_walks.mark_wanted``).

    Assigning ``wanted`` bumps ``epoch`` when a node leaves the set (its priority drops); a node
    joining it only raises its priority. Mutate the set in place only by adding to it."""

    monotone = True

    def __init__(self) -> None:
        self._wanted: set[int] = set()
        self.epoch = 0

    @property
    def wanted(self) -> set[int]:
        return self._wanted

    @wanted.setter
    def wanted(self, new: set[int]) -> None:
        if not self._wanted <= new:
            self.epoch += 1
        self._wanted = new

    def priority(self, node: Any) -> Any:
        return (node.id in self._wanted, node.last_access_time)


EVICTION_STRATEGIES: dict[str, type] = {"lru": LRUStrategy, "lfu": LFUStrategy, "queue-aware": QueueAwareStrategy}


def get_eviction_strategy(name: str) -> EvictionStrategy:
    try:
        return EVICTION_STRATEGIES[name]()
    except KeyError:
        raise ValueError(f"unknown radix eviction policy {name!r}; choose from {sorted(EVICTION_STRATEGIES)}") from None
