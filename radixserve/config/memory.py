"""The memory area of ``ServerArgs``: the KV pool's size and pages, and the prefix cache."""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.options import not_positive, option

RADIX_EVICTION_POLICIES = ("lru", "lfu", "queue-aware")
HICACHE_WRITE_POLICIES = ("write_back", "write_through", "write_through_selective")
HICACHE_BACKENDS = ("file", "memory")


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
    disable_hybrid_swa_memory: bool = option(
        False, "Keep every position's K/V in the sliding-window layers of a model that mixes them with global "
        "layers (Gemma 2, 3), as in the global ones. Default: those layers keep only the windows they can still "
        "read, in KV pages of their own (docs/model.md); always so with --enable-hierarchical-cache, "
        "disaggregation, tensor parallelism or a draft model.", group="memory")

    enable_hierarchical_cache: bool = option(
        False, "Keep KV that leaves the pool in a second tier (docs/kv_tiers.md): a prefix evicted from the pool "
        "is loaded back instead of computed again, while its request waits in the queue.", group="memory")
    hicache_ratio: float = option(
        2.0, "The tier's size as a multiple of the KV pool's bytes (unless --hicache-size is given).", group="memory")
    hicache_size: float = option(
        0.0, "The tier's size in GiB; overrides --hicache-ratio when above 0.", group="memory")
    hicache_write_policy: str = option(
        "write_through", "When KV is copied to the tier. write_back: when it is evicted from the pool. "
        "write_through: as soon as it is cached (a prefix is in both, evicting costs nothing). "
        "write_through_selective: when a prefix is matched the second time.", HICACHE_WRITE_POLICIES,
        group="memory")
    hicache_storage_backend: str = option(
        "file", "Where the tier keeps its blocks. file: one file per block under --hicache-storage-dir "
        "(survives restarts); memory: this process's memory.", HICACHE_BACKENDS, group="memory")
    hicache_storage_dir: str | None = option(
        None, "The file tier's directory (a subdirectory per model is made in it). Default: "
        "~/.cache/radixserve/hicache.", group="memory")

    def _memory_errors(self) -> list[str]:
        errors = not_positive(self, "max_total_tokens") + not_positive(self, "page_size", allow_none=False)
        if not self.hicache_ratio > 0:
            errors.append(f"hicache_ratio must be above 0, got {self.hicache_ratio!r}")
        if not self.hicache_size >= 0:
            errors.append(f"hicache_size must be 0 or more (GiB), got {self.hicache_size!r}")
        if not 0.0 < self.mem_fraction_static < 1.0:
            errors.append("mem_fraction_static must be in (0, 1)")
        return errors
