"""Eviction order of unlocked radix leaves: a strategy is one method, ``priority(node)``; the
smallest priority is evicted first."""

from __future__ import annotations

from typing import Any, Protocol


class EvictionStrategy(Protocol):
    def priority(self, node: Any) -> Any: ...


class LRUStrategy:
    """Least recently used first."""

    def priority(self, node: Any) -> Any:
        return node.last_access_time


class LFUStrategy:
    """Least frequently hit first, least recently used among equals."""

    def priority(self, node: Any) -> Any:
        return (node.hit_count, node.last_access_time)


class QueueAwareStrategy:
    """Leaves no waiting request is about to reuse first (LRU among them), then the wanted ones (LRU).

    ``wanted`` holds the ids of the nodes on the cached paths of the waiting requests; the scheduler
    refreshes it before each prefill round (``radixserve.sched.queue_aware.mark_wanted``)."""

    def __init__(self) -> None:
        self.wanted: set[int] = set()

    def priority(self, node: Any) -> Any:
        return (node.id in self.wanted, node.last_access_time)


EVICTION_STRATEGIES: dict[str, type] = {"lru": LRUStrategy, "lfu": LFUStrategy, "queue-aware": QueueAwareStrategy}


def get_eviction_strategy(name: str) -> EvictionStrategy:
    try:
        return EVICTION_STRATEGIES[name]()  # type: ignore[no-any-return]
    except KeyError:
        raise ValueError(f"unknown radix eviction policy {name!r}; choose from {sorted(EVICTION_STRATEGIES)}") from None
