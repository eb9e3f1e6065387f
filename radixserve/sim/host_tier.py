"""The host tier in the simulator: the engine's own ``HiCache`` behind the radix cache of a
simulated GPU worker (``--enable-hierarchical-cache``), with its loads timed by the cost model.

What runs is the engine's code: the write policies copy blocks out of the pool as the tree evicts or
caches them, a waiting request's prefix found in the tier is prefetched while it waits, and lands
in fresh pool slots and the tree at a later step. Three things differ, all so that a run of many
workers is deterministic and small:

- the pool holds a byte per token for K and for V (the blocks' payloads), and each block counts
  ``block tokens x the cost model's KV bytes per token`` against the cap: ``--hicache-ratio`` and
  ``--hicache-size`` mean what they mean on the GPU being modelled;
- the tier is host memory (``--hicache-storage-backend`` is not modelled) and reads and writes run
  in the scheduler's thread, not on tier threads;
- a load lands when the worker's host link has moved it (``CostModel.tier_load_s``: PCIe latency +
  bytes / bandwidth on the h100 model; one load at a time per worker) on the virtual clock.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from radixserve.config import ServerArgs
from radixserve.mem.cache_events import CacheEvent
from radixserve.mem.kv_pool import KVPool
from radixserve.mem.kv_tier import KVTier
from radixserve.mem.tier_store import MemoryStore
from radixserve.sched.kv_manager import KVManager
from radixserve.sched.kv_tiering import HiCache
from radixserve.sched.tier_events import TierEvents
from radixserve.sched.tier_setup import BLOCK_TOKENS, tier_capacity
from radixserve.sim.cost_model import CostModel


def attach_host_tier(args: ServerArgs, kv: KVManager, cost: CostModel, clock: Callable[[], float],
                     event_sink: Callable[[CacheEvent], None] | None = None) -> HiCache:
    """Build the tier over ``kv``'s tree and a stand-in pool, and attach it."""
    assert kv.prefix_tree is not None  # the options refuse the tier without a radix cache
    ps = kv.page_size
    block = -(-BLOCK_TOKENS // ps) * ps
    total = kv.allocator.size
    pool = KVPool(total, ps, 1, 1, 1, torch.uint8)  # K and V a byte each: the blocks' stand-in payload
    device_bytes = cost.kv_bytes_per_token()
    tier = KVTier(MemoryStore(), model_id=b"simulated-model", block_tokens=block,
                  capacity_bytes=tier_capacity(args, total * device_bytes), inline=True,
                  block_bytes=block * device_bytes)
    events = TierEvents(event_sink, "CPU") if event_sink is not None else None
    hc = HiCache(kv.prefix_tree, kv.allocator, pool, tier, args.hicache_write_policy, clock=clock, events=events,
                 transfer_s=cost.tier_load_s)
    kv.attach_tier(hc)
    return hc


def tier_figures(kvs: list[KVManager]) -> dict[str, float] | None:
    """The host tiers' work over a run (all workers'), or None without a tier: prefixes loaded back,
    their tokens, and the mean time a load took on the virtual clock (link queue included)."""
    tiers = [kv.tier for kv in kvs if kv.tier is not None]
    if not tiers:
        return None
    loads = sum(t.stats.loads for t in tiers)
    seconds = sum(t.stats.load_seconds for t in tiers)
    return {"loads": loads, "loaded_tokens": sum(t.stats.hit_tokens for t in tiers),
            "mean_load_ms": round(seconds / loads * 1e3, 4) if loads else 0.0,
            "blocks_stored": sum(len(t.tier) for t in tiers),
            "no_room": sum(t.stats.no_room for t in tiers)}
