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


EVICTION_STRATEGIES: dict[str, type] = {"lru": LRUStrategy, "lfu": LFUStrategy}


def get_eviction_strategy(name: str) -> EvictionStrategy:
    try:
        return EVICTION_STRATEGIES[name]()  # type: ignore[no-any-return]
    except KeyError:
        raise ValueError(f"unknown radix eviction policy {name!r}; choose from {sorted(EVICTION_STRATEGIES)}") from None
