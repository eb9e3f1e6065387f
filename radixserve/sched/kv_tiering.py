"""``HiCache``: the KV tier (``mem.kv_tier``) wired to the radix cache and the KV pool, SGLang's
hierarchical cache on a CPU: what falls out of the pool is found again on disk (or in memory).

    pool (RadixCache) ──copy out (write policy)──> KVTier ──writer thread──> TierStore (file | memory)
          ^                                          │
          └──── fresh slots + insert <── poll <── reader thread (read, check) <── prefetch(req)

Writes (``--hicache-write-policy``), in tier blocks aligned from the prefix's start: a node that
spans tokens ``[s, e)`` of its path copies out blocks ``s // B .. e // B - 1`` that the tier lacks
(the first may begin in its parent, still in the pool: parents are evicted after their children;
the block that runs past ``e`` waits for the node's child or its next extension):
- ``write_back``: when the node is evicted from the pool;
- ``write_through``: when it enters the cache;
- ``write_through_selective``: when a match passes through it the second time (reused prefixes).
The copy out of the pool happens at once (the slots are about to be reused); the write to the
store on the writer thread.

Loads, as prefetch (SGLang's ``_prefetch_kvcache``): a request that arrives while the tier holds
blocks after its cached prefix does not join the waiting queue yet. Its cached prefix is locked,
the reader thread reads and checks the blocks, and at the start of a later step (``poll``) their KV
goes into fresh pool slots and into the tree; then the request joins the waiting queue and its
match finds the longer prefix. No step waits on the tier: a load that finds no room in the pool,
or a block that fails its checks, only shortens what is loaded (the rest is computed again).

Under ``--hicache-storage-backend file`` the blocks are files under
``--hicache-storage-dir/<model identity>``: a restarted server finds them again.

``transfer_s(tokens)``: the time a load of ``tokens`` tokens takes on a link carrying one load at a
time (the simulator's PCIe model, on its clock); a load lands no earlier. Unset: the reader's time.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any

from radixserve.mem.allocator import OutOfKVSlots, TokenToKVPoolAllocator
from radixserve.mem.base_cache import RadixKey
from radixserve.mem.kv_pool import KVPool
from radixserve.mem.kv_tier import Fetched, KVTier, chain_keys, chain_root, split_payloads
from radixserve.mem.radix_cache import RadixCache
from radixserve.mem.tree_node import TreeNode
from radixserve.sched.req import Req
from radixserve.sched.tier_events import TierEvents

logger = logging.getLogger(__name__)

WRITE_POLICIES = ("write_back", "write_through", "write_through_selective")
SELECTIVE_HITS = 2  # write_through_selective: a node is written when a match passes it this often


@dataclass
class Load:
    req: Req
    key: RadixKey
    node: TreeNode  # end of the cached prefix, locked while the load runs
    prefix: list[int]  # the cached prefix's slots
    first_block: int
    end: int  # where the prefix ends if every block loads
    future: Future[Fetched]
    started: float
    cancelled: bool = False
    ready_at: float = 0.0  # not landed before this time (transfer_s), whatever the future says


@dataclass
class LoadStats:
    loads: int = 0
    hit_tokens: int = 0  # tokens put back into the pool from the tier
    load_seconds: float = 0.0
    no_room: int = 0  # loads dropped: the pool had no room
    failed: int = 0
    seconds: list[float] = field(default_factory=list)  # recent load latencies


class HiCache:
    def __init__(self, tree: RadixCache, allocator: TokenToKVPoolAllocator, pool: KVPool, tier: KVTier,
                 write_policy: str = "write_through",
                 on_written: Callable[[list[int], list[int]], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, events: TierEvents | None = None,
                 transfer_s: Callable[[int], float] | None = None) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write policy must be one of {', '.join(WRITE_POLICIES)}; got {write_policy!r}")
        if tier.block_tokens % allocator.page_size:
            raise ValueError("tier blocks must be whole pages")
        self.tree, self.allocator, self.pool, self.tier = tree, allocator, pool, tier
        self.write_policy = write_policy
        self.on_written = on_written
        self.clock = clock
        self.transfer_s = transfer_s
        self._link_free = 0.0  # when the link (transfer_s) has moved every load started so far
        self._seen_evictions = 0  # the tree's evicted_nodes at the last recheck
        self.B = tier.block_tokens
        self.loads: dict[Req, Load] = {}
        self.holds: dict[Req, int] = {}  # requests whose loaded prefix waits locked for admission: tokens
        self.staged: dict[Req, Load] = {}  # read, waiting for room in the pool (their request waits too)
        self._freed: list[Req] = []  # requests whose staged load was given up: handed back at the next poll
        self.stats = LoadStats()
        self.events = events  # the tier's blocks as cache events (--cache-events-port), or None
        # what a persistent tier found at start, reported when the first request arrives (a router
        # sending requests here has subscribed to the events by then; at start it may not have)
        self._announce: Callable[[], None] | None = None
        if events is not None:
            tier.on_drop = events.dropped
            self._announce = functools.partial(events.found, tier.found_blocks(), chain_root(tier.model_id, None))
        # the one tree hook the write policy needs
        if write_policy == "write_through":
            tree.on_new_leaf = self._copy_out
        elif write_policy == "write_back":
            tree.on_evicting = self._copy_out
        else:
            tree.on_hit = self._copy_out_on_reuse

    # --- copy out of the pool -------------------------------------------------------------------
    def _copy_out_on_reuse(self, node: TreeNode) -> None:
        if node.hit_count == SELECTIVE_HITS:
            self._copy_out(node)

    def _copy_out(self, node: TreeNode) -> None:
        chain: list[TreeNode] = []
        n: TreeNode | None = node
        while n is not None and n.parent is not None:
            chain.append(n)
            n = n.parent
        e = sum(len(c.key) for c in chain)
        lo, hi = (e - len(node.key)) // self.B, e // self.B
        if hi <= lo:
            return
        toks: list[int] = []
        slots: list[int] = []
        for c in reversed(chain):
            toks += c.key
            slots += c.value
        root = chain_root(self.tier.model_id, node.extra_key)
        keys = chain_keys(root, toks, self.B, hi)
        B = self.B
        first = None
        for b in range(lo, hi):
            if keys[b] not in self.tier:
                parts = self.pool.gather(slots[b * B : (b + 1) * B])
                if self.tier.put(keys[b], keys[b - 1] if b else root, toks[b * B : (b + 1) * B], parts) and first is None:
                    first = b
        self.tier.touch(keys)
        if first is not None and self.events is not None and node.extra_key is None:
            self.events.stored(toks[: hi * B], keys, root, self.tier.__contains__)

    # --- loads ----------------------------------------------------------------------------------
    def prefetch(self, req: Req) -> bool:
        """Start loading ``req``'s prefix from the tier if the tier holds blocks past its cached
        prefix; True: ``req`` waits here until ``poll`` hands it back."""
        if self._announce is not None:
            self._announce()
            self._announce = None
        if req.kv_indices or req in self.loads:
            return False
        key = req.match_key()
        ids = key.token_ids
        n_blocks = len(ids) // self.B
        cached = self.tree.peek_prefix_len(key)
        b0 = cached // self.B
        if b0 >= n_blocks or self.held_tokens() + (n_blocks * self.B - cached) > self.allocator.size:
            return False
        root = chain_root(self.tier.model_id, key.extra_key)
        keys = chain_keys(root, ids, self.B, n_blocks)
        k = self.tier.present_run(keys[b0:])
        if k == 0:
            return False
        m = self.tree.match_prefix(key)
        if len(m.device_indices) != cached or m.last_node is None:
            return False
        self.tree.inc_lock_ref(m.last_node)
        B = self.B
        fut = self.tier.fetch(keys[b0 : b0 + k], [keys[b - 1] if b else root for b in range(b0, b0 + k)],
                              [ids[b * B : (b + 1) * B] for b in range(b0, b0 + k)])
        ld = self.loads[req] = Load(req, key, m.last_node, list(m.device_indices), b0, (b0 + k) * B, fut, self.clock())
        if self.transfer_s is not None:
            ld.ready_at = self._link_free = max(ld.started, self._link_free) + self.transfer_s(ld.end - cached)
        return True

    def next_ready(self) -> float | None:
        """When the next load in transfer lands (``transfer_s``), if one waits on the link now."""
        return min((ld.ready_at for ld in self.loads.values() if ld.ready_at > self.clock()), default=None)

    def recheck(self, waiting: list[Req], limit: int = 4) -> list[Req]:
        """The first ``limit`` queued requests (the next to run) whose prefix was evicted from the pool
        after they queued, and is in the tier: their loads start, as at arrival. Looked at only after
        the tree evicted something (a prompt's names are hashed again for each look)."""
        if self.tree.evicted_nodes == self._seen_evictions:
            return []
        self._seen_evictions = self.tree.evicted_nodes
        return [req for req in waiting[:limit] if req.tier_hold is None and self.prefetch(req)]

    def held_tokens(self) -> int:
        """Pool tokens locked for requests not admitted yet (landed loads), or on their way (read or
        waiting for room)."""
        return sum(self.holds.values()) + sum(ld.end - len(ld.prefix)
                                              for ld in (*self.loads.values(), *self.staged.values()))

    def drop_holds(self) -> bool:
        """Unlock every loaded prefix still waiting for its request's admission (they stay cached,
        evictable), and give up the loads still waiting for room (their requests compute): when
        nothing runs and nothing can be admitted, these locks may be what stands in the way.
        Whether there were any."""
        reqs = list(self.holds)
        for req in reqs:
            self.unhold(req)
        staged = list(self.staged.values())
        for ld in staged:
            self._give_up(ld)
        self.staged.clear()
        self._freed.extend(ld.req for ld in staged if not ld.cancelled)
        return bool(reqs or staged)

    def unhold(self, req: Req) -> None:
        """``req`` is admitted (its own lock pins its prefix now) or leaves: drop the tier's lock."""
        if req.tier_hold is not None:
            self.tree.dec_lock_ref(req.tier_hold)
            req.tier_hold = None
            self.holds.pop(req, None)

    def _give_up(self, ld: Load) -> None:
        """A load that found no room: its KV is dropped, its request computes the prompt."""
        self.stats.no_room += 1
        self.tree.dec_lock_ref(ld.node)

    def cancel(self, req: Req) -> bool:
        """``req`` is aborted while loading: its load completes (the KV is cached) but it is not handed back."""
        ld = self.loads.get(req) or self.staged.get(req)
        if ld is None:
            return False
        ld.cancelled = True
        return True

    def parked(self) -> int:
        """Requests waiting here: their blocks being read, or read and waiting for room."""
        return len(self.loads) + len(self.staged) + len(self._freed)

    def parked_reqs(self) -> list[Req]:
        return [*self.loads, *self.staged, *self._freed]

    def wait(self, timeout: float) -> None:
        """Block until a load completes or ``timeout`` seconds pass (the loop has nothing else to do)."""
        if self.loads:
            wait_futures([ld.future for ld in self.loads.values()], timeout=timeout, return_when=FIRST_COMPLETED)
        elif self.staged:
            time.sleep(timeout)  # waiting for room: something else has to end first

    def poll(self) -> list[Req]:
        """Take in the tier's finished writes, and finish the loads that are read: their KV into the
        pool and the tree. A load that finds no room in the pool waits (its blocks in memory) and
        tries again at each poll, before the step that could take the room is built. Returns the
        requests that may now be scheduled, in arrival order."""
        self.tier.poll()
        ready, self._freed = self._freed, []
        for req, ld in list(self.staged.items()):
            if self._try_land(ld):
                del self.staged[req]
                if not ld.cancelled:
                    ready.append(req)
        now = self.clock()
        for req, ld in list(self.loads.items()):
            if not ld.future.done() or ld.ready_at > now:
                continue
            del self.loads[req]
            self._drop_bad(ld)
            if not self._try_land(ld):
                self.staged[req] = ld
            elif not ld.cancelled:
                ready.append(req)
        return ready

    def _drop_bad(self, ld: Load) -> None:
        for name, why in ld.future.result().bad:
            self.tier.forget(name)
            self.tier.stats.corrupt_blocks += 1
            logger.warning("KV tier: skipped a stored block of request %s (%s); its KV is computed again",
                           ld.req.rid, why)

    def _try_land(self, ld: Load) -> bool:
        """Land ``ld``; False if the pool has no room now (it keeps its lock and may try again).
        A cancelled load is not kept waiting for room."""
        try:
            landed = self._land(ld)
        except Exception:  # the request goes on without the tier's KV
            self.stats.failed += 1
            logger.exception("KV tier: loading request %s's prefix failed; it is computed instead", ld.req.rid)
            landed = True
        if landed:
            self.tree.dec_lock_ref(ld.node)
        elif ld.cancelled:
            self._give_up(ld)
            return True
        return landed

    def _land(self, ld: Load) -> bool:
        """Put ``ld``'s KV into the pool and the tree; False if there is no room for it now."""
        got = ld.future.result()
        if not got.payloads:
            return True
        B, p = self.B, len(ld.prefix)
        end = (ld.first_block + len(got.payloads)) * B
        if end - p > self.allocator.available_size() + self.tree.evictable_size():
            return False
        parts = split_payloads(got.payloads, B, self.pool.part_row_bytes(), p - ld.first_block * B)
        avail = self.allocator.available_size()
        if end - p > avail:
            self.tree.evict(end - p - avail)
        try:
            slots = self.allocator.alloc(end - p)
        except OutOfKVSlots:
            return False
        try:
            nbytes = self.pool.scatter(slots, parts)
        except Exception:
            self.allocator.free(slots)
            raise
        ids = ld.key.token_ids
        key = RadixKey(ids[:end], ld.key.extra_key)
        dup = self.tree.insert(key, ld.prefix + slots) - p
        if dup > 0:
            self.allocator.free(slots[:dup])
        if not ld.cancelled:  # locked until the request is admitted: what runs meanwhile cannot evict it
            hold = self.tree.match_prefix(key).last_node
            self.tree.inc_lock_ref(hold)
            ld.req.tier_hold = hold
            self.holds[ld.req] = end - p
        kept = max(dup, 0)
        if self.on_written is not None and kept < len(slots):
            self.on_written(slots[kept:], list(ids[p + kept : end]))
        s = self.stats
        s.loads += 1
        s.hit_tokens += len(slots) - kept
        took = self.clock() - ld.started
        s.load_seconds += took
        s.seconds = (s.seconds + [took])[-256:]
        self.tier.stats.blocks_loaded += len(got.payloads)
        self.tier.stats.bytes_loaded += nbytes
        return True

    # --- admin ----------------------------------------------------------------------------------
    def flush(self) -> None:
        """Drop every cached prefix, the tier's too (only when idle)."""
        evicting, self.tree.on_evicting = self.tree.on_evicting, None  # nothing is copied out on the way
        if self.events is not None:
            self.events.muted = True  # the tree's AllCleared covers the tier's blocks
        try:
            self.tree.evict(self.tree.evictable_size())
            self.tier.clear()
        finally:
            self.tree.on_evicting = evicting
            if self.events is not None:
                self.events.muted = False
                self.events.clear()

    def check(self) -> None:
        if self.loads or self.holds or self.staged:
            raise AssertionError(f"at idle: {len(self.loads)} KV tier loads in flight, {len(self.staged)} waiting "
                                 f"for room, {len(self.holds)} held")
        self.tier.poll()
        self.tier.check_integrity()

    def snapshot(self) -> dict[str, Any]:
        """Figures for ``/get_server_info``, ``/metrics`` and the dashboard (the writes that landed
        since the last step counted in)."""
        t, s = self.tier, self.stats
        t.poll()
        lat = sorted(s.seconds)
        return {
            "backend": t.store.name, "write_policy": self.write_policy, "block_tokens": self.B,
            "blocks": len(t), "used_bytes": t.used_bytes, "capacity_bytes": t.capacity_bytes,
            "blocks_written": t.stats.blocks_written, "bytes_written": t.stats.bytes_written,
            "write_errors": t.stats.write_errors, "evicted_blocks": t.stats.evicted_blocks,
            "corrupt_blocks": t.stats.corrupt_blocks, "loads": s.loads, "loading": self.parked(),
            "hit_tokens": s.hit_tokens, "bytes_loaded": t.stats.bytes_loaded,
            "load_seconds_total": round(s.load_seconds, 6),
            "load_seconds_p50": lat[len(lat) // 2] if lat else None, "loads_no_room": s.no_room,
        }

    def counts(self) -> dict[str, Any]:
        """``SchedulerStats``' tier fields (cumulative, but the bytes held)."""
        t = self.tier.stats
        return {"hicache_used_bytes": self.tier.used_bytes, "hicache_hit_tokens": self.stats.hit_tokens,
                "hicache_loads": self.stats.loads, "hicache_load_seconds": self.stats.load_seconds,
                "hicache_bytes_written": t.bytes_written, "hicache_bytes_loaded": t.bytes_loaded,
                "hicache_write_errors": t.write_errors}

    def close(self) -> None:
        self.tree.on_new_leaf = self.tree.on_hit = self.tree.on_evicting = None
        self.tier.close()
