"""The memory area of ``ServerArgs``: the KV pool's size and pages, and the prefix cache."""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.options import not_positive, option

RADIX_EVICTION_POLICIES = ("lru", "lfu", "queue-aware")


@dataclass(frozen=True)
class MemoryOptions:
    max_total_tokens: int | None = option(
        None, "KV pool size in tokens. Default: sized from --mem-fraction-static of system memory.", group="memory"
    )
    mem_fraction_static: float = option(
        0.15, "Fraction of system memory given to the KV pool when --max-total-tokens is unset.", group="memory"
    )
    page_size: int = option(1, "Tokens per KV page; the radix cache matches whole pages only.", group="memory")
    disable_radix_cache: bool = option(False, "Use a ChunkCache that shares nothing instead of the RadixCache.", group="memory")
    radix_eviction_policy: str = option("lru", "Order in which unlocked radix leaves are evicted; queue-aware: leaves no waiting request "
        "is about to reuse first, then LRU.", RADIX_EVICTION_POLICIES, group="memory")

    def _memory_errors(self) -> list[str]:
        errors = not_positive(self, "max_total_tokens") + not_positive(self, "page_size", allow_none=False)
        if not 0.0 < self.mem_fraction_static < 1.0:
            errors.append("mem_fraction_static must be in (0, 1)")
        return errors
