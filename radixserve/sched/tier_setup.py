"""Building the KV tier from the options: its store (``--hicache-storage-backend``, a directory per
model under ``--hicache-storage-dir``), its cap and block size, and the ``HiCache`` over the pool."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from radixserve.config import ServerArgs
from radixserve.mem.allocator import TokenToKVPoolAllocator
from radixserve.mem.kv_pool import KVPool
from radixserve.mem.kv_tier import KVTier
from radixserve.mem.radix_cache import RadixCache
from radixserve.mem.tier_store import FileStore, MemoryStore, TierStore
from radixserve.sched.kv_tiering import HiCache
from radixserve.sched.tier_events import TierEvents

logger = logging.getLogger(__name__)

BLOCK_TOKENS = 64  # tokens per tier block (rounded up to whole pages)


def tier_capacity(args: ServerArgs, pool_bytes: int) -> int:
    """``--hicache-size`` GB, else ``--hicache-ratio`` times the pool."""
    if args.hicache_size:
        return int(args.hicache_size * 2**30)
    return int(args.hicache_ratio * pool_bytes)


def open_store(args: ServerArgs, model_id: bytes, dp_rank: int | None = None) -> TierStore | None:
    """The ``--hicache-storage-backend`` store, or None (logged) if it cannot be opened: the server
    then runs without a tier."""
    if args.hicache_storage_backend == "memory":
        return MemoryStore()
    root = args.hicache_storage_dir or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "radixserve", "hicache")
    path = os.path.join(root, model_id.hex()[:16] + (f"-dp{dp_rank}" if dp_rank else ""))
    try:
        return FileStore(path)
    except OSError as e:
        logger.error("KV tier: cannot use %s (%s); running without the tier (evicted prefixes are "
                     "computed again)", path, e)
        return None


def build_hicache(args: ServerArgs, tree: RadixCache, allocator: TokenToKVPoolAllocator, pool: KVPool,
                  model_id: bytes, on_written: Callable[[list[int], list[int]], None] | None = None,
                  dp_rank: int | None = None) -> HiCache | None:
    """The tier ``--enable-hierarchical-cache`` asks for, over ``pool`` (None if its store cannot be opened)."""
    store = open_store(args, model_id, dp_rank)
    if store is None:
        return None
    ps = allocator.page_size
    block = -(-BLOCK_TOKENS // ps) * ps
    cap = tier_capacity(args, pool.size * pool.bytes_per_token_here())
    tier = KVTier(store, model_id=model_id, block_tokens=block, capacity_bytes=cap)
    logger.info("KV tier: %s store, %.2f GiB cap, %d-token blocks, %s", store.name, cap / 2**30, block,
                args.hicache_write_policy)
    sink = tree.event_sink  # the pool's cache events go out: the tier's go with them
    events = TierEvents(sink, "DISK" if store.persistent else "CPU") if sink is not None else None
    return HiCache(tree, allocator, pool, tier, args.hicache_write_policy, on_written, events=events)
