"""``KVManager``: the one door to KV memory (request slots, KV slots, the prefix cache).

Nothing else holds the allocator or the prefix cache. The scheduler asks this manager to match and
admit a request's prefix, grow a request by N tokens (evicting cache leaves when the free list runs
dry), release a request into the cache and check the accounting invariant; a disaggregated decode
worker reserves slots for KV that arrives from elsewhere and adopts it into the cache
(``reserve`` / ``adopt`` / ``unlock``), and the prefill side reads a cached prompt's slots. Policies
and the dashboard get a read-only view of the radix tree (``prefix_tree``), None without one.
With ``--enable-hierarchical-cache`` the KV tier behind the tree is here too (``attach_tier``): a
request whose prefix the tier holds is loaded before it is queued (``prefetch`` / ``poll_loads``).

Sliding windows let it give KV back before a request ends (``Windows``, kv_windows.py: the rule).
"""

from __future__ import annotations

from collections import deque
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from radixserve.mem.allocator import OutOfKVSlots, TokenToKVPoolAllocator
from radixserve.mem.base_cache import BasePrefixCache, RadixKey
from radixserve.mem.kv_pool import ReqToTokenPool
from radixserve.mem.radix_cache import RadixCache
from radixserve.mem.window_kv import WindowKV
from radixserve.sched.kv_windows import Windows
from radixserve.sched.req import Req

if TYPE_CHECKING:
    from radixserve.sched.kv_tiering import HiCache


class Hold:
    """A cached prefix pinned for someone outside the scheduler's requests (``KVManager.adopt``):
    opaque; give it back with ``KVManager.unlock``."""

    __slots__ = ("_node",)

    def __init__(self, node: Any) -> None:
        self._node = node


class KVManager:
    def __init__(
        self, req_to_token_pool: ReqToTokenPool, allocator: TokenToKVPoolAllocator, tree_cache: BasePrefixCache,
        window: int | None = None, window_kv: WindowKV | None = None,
    ) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.tree_cache = tree_cache
        self.page_size = allocator.page_size
        # the radix tree, read-only, for the cache-aware policies and the dashboard
        self.prefix_tree: RadixCache | None = tree_cache if isinstance(tree_cache, RadixCache) else None
        self._reserved = 0  # slots reserved outside any request (KV on its way in)
        self._holds = 0  # live Holds
        self.tier: HiCache | None = None
        self.windows = Windows(allocator, window, window_kv)
        if window_kv is not None:
            allocator.attach_window_kv(window_kv)
            req_to_token_pool.attach_window_kv(window_kv)

    @property
    def window(self) -> int | None:
        """A whole-model sliding window: own slots behind it are freed."""
        return self.windows.window

    @property
    def window_kv(self) -> WindowKV | None:
        """The sliding layers' own pages, beside global layers."""
        return self.windows.window_kv

    def attach_tier(self, tier: HiCache | None) -> None:
        """The KV tier behind the prefix cache (``tier_setup.build_hicache``), once the pool exists."""
        self.tier = tier

    # --- the KV tier: a request waits for its prefix to load before it is queued ------------------
    def prefetch(self, req: Req) -> bool:
        """Start loading ``req``'s prefix from the tier; True: it waits for ``poll_loads`` to hand it back."""
        return self.tier is not None and self.tier.prefetch(req)

    def recheck_tier(self, waiting: list[Req]) -> list[Req]:
        """Queued requests whose cached prefix the pool lost since they queued and the tier holds: their
        loads start now (``HiCache.recheck``); the caller takes them out of the queue."""
        return self.tier.recheck(waiting) if self.tier is not None else []

    def poll_loads(self) -> list[Req]:
        """The requests whose prefix is loaded now (their KV is in the pool and the tree)."""
        return self.tier.poll() if self.tier is not None else []

    def loads_pending(self) -> int:
        """Requests waiting for their prefix to load."""
        return self.tier.parked() if self.tier is not None else 0

    def next_load_time(self) -> float | None:
        """When the next prefix load in transfer lands, on the tier's clock (a simulated link), or None."""
        return self.tier.next_ready() if self.tier is not None else None

    def wait_loads(self, timeout: float) -> None:
        if self.tier is not None:
            self.tier.wait(timeout)

    def tier_held(self) -> set[Req]:
        """Waiting requests whose prefix the tier loaded, locked for them until they are admitted."""
        return set(self.tier.holds) if self.tier is not None else set()

    def drop_tier_holds(self) -> bool:
        """Unlock the loaded prefixes that wait for their requests' admission; whether there were any."""
        return self.tier is not None and self.tier.drop_holds()

    def close(self) -> None:
        """Let the tier finish its writes (a restart finds them) and stop its threads."""
        if self.tier is not None:
            self.tier.close()
            self.tier = None

    def cancel_load(self, req: Req) -> bool:
        """Whether ``req`` was waiting for a load (it is not handed back now)."""
        return self.tier is not None and self.tier.cancel(req)

    @property
    def total_tokens(self) -> int:
        return self.allocator.size

    def available_size(self) -> int:
        return self.allocator.available_size()

    def evictable_size(self) -> int:
        return self.tree_cache.evictable_size()

    def protected_size(self) -> int:
        return self.tree_cache.protected_size()

    def reclaimable_size(self) -> int:
        """Slots that could be had now: free ones plus unlocked cache leaves."""
        return self.allocator.available_size() + self.tree_cache.evictable_size()

    def evicted(self) -> tuple[int, int]:
        """Tokens and tree nodes evicted since start (a flush counts too); (0, 0) without a tree."""
        t = self.prefix_tree
        return (t.evicted_tokens, t.evicted_nodes) if t is not None else (0, 0)

    def usage(self) -> float:
        """Fraction of the pool not free and not evictable (held by running requests)."""
        return 1.0 - self.reclaimable_size() / self.total_tokens

    # --- the prefix cache, as the scheduler's policies and rules need it ---------------------------
    def match(self, req: Req) -> None:
        """Plan ``req``'s next extend: match its next input against the prefix cache (for a request
        holding no KV yet: ``prefix_indices``, ``last_node``) and set ``extend_input_len``."""
        if req.kv_indices:  # a chunked request continuing: its prefix is its own KV
            req.extend_input_len = req.num_tokens - req.num_computed_tokens
            return
        key = req.match_key()
        m = self.tree_cache.match_prefix(key)
        if self.window_kv is not None and len(m.device_indices):
            usable = self.window_kv.usable_prefix(m.device_indices)
            if usable < len(m.device_indices):  # the sliding layers' window before the end is not whole
                m = self.tree_cache.match_prefix(RadixKey(key.token_ids[:usable], key.extra_key))
        req.set_match(m)

    def lock_match(self, req: Req) -> None:
        """Pin ``req``'s matched prefix so this step's evictions cannot take it."""
        self.tree_cache.inc_lock_ref(req.last_node)

    def unlock_match(self, req: Req) -> None:
        self.tree_cache.dec_lock_ref(req.last_node)

    def cache_unfinished(self, req: Req) -> None:
        """Insert ``req``'s computed KV into the cache now (a finished chunk or prompt), keeping it locked."""
        assert req.kv_freed_to <= req.cache_protected_len, "a prompt being cached has no slots freed behind a window"
        self.windows.cache(req, self.tree_cache.cache_unfinished_req)

    def uncached_tokens(self, req: Req) -> int:
        """Prompt tokens ``req`` still has to prefill: exact once admitted, else a read-only match."""
        if req.kv_indices:
            return req.num_tokens - req.num_computed_tokens
        return len(req.fill_ids) - self.tree_cache.peek_prefix_len(req.match_key())

    def exclusive_cached_tokens(self, req: Req) -> int:
        """Cached tokens only ``req`` pins: evictable once it lets go."""
        return self.tree_cache.exclusive_locked_tokens(req.last_node)

    def mark_wanted(self, waiting: list[Req]) -> None:
        """Queue-aware eviction: keep the waiting requests' cached prefixes longest."""
        self.tree_cache.mark_wanted(r.match_key() for r in waiting)

    def flush(self) -> None:
        """Drop every cached prefix, the tier's too (only when no request holds KV)."""
        if self.tier is not None:
            self.tier.flush()
        self.tree_cache.evict(self.tree_cache.evictable_size())
        self.tree_cache.reset()

    # --- KV from outside the scheduler's requests (prefill/decode disaggregation) -------------------
    def cached_slots(self, ids: list[int]) -> list[int]:
        """The KV slots of the longest cached prefix of ``ids`` (read while no step runs)."""
        return list(self.tree_cache.match_prefix(RadixKey(ids)).device_indices)

    def reserve(self, tokens: int) -> list[int]:
        """Whole pages for ``tokens`` tokens of KV that will be written from outside, evicting cache
        leaves if needed; ``OutOfKVSlots`` when even that is not enough."""
        need = -(-tokens // self.page_size) * self.page_size
        if need > self.allocator.available_size():
            self.tree_cache.evict(need - self.allocator.available_size())
        slots = self.allocator.alloc(need)
        self._reserved += len(slots)
        return slots

    def unreserve(self, slots: list[int]) -> None:
        """Give back reserved slots that were never adopted."""
        self.allocator.free(slots)
        self._reserved -= len(slots)

    def adopt(self, ids: list[int], slots: list[int], n: int) -> Hold:
        """The KV of ``ids[:n]`` was written into the reserved ``slots[:n]``: put it in the prefix
        cache, locked, and free the reserved slots it did not take (duplicates of what the cache
        had, and the tail past ``n``)."""
        tree = self.tree_cache
        dup = tree.insert(RadixKey(ids[:n]), slots[:n]) if n else 0
        self.allocator.free(slots[:dup] + slots[n:])
        self._reserved -= len(slots)
        m = tree.match_prefix(RadixKey(ids[:n]))
        tree.inc_lock_ref(m.last_node)
        self._holds += 1
        return Hold(m.last_node)

    def unlock(self, hold: Hold) -> None:
        self.tree_cache.dec_lock_ref(hold._node)
        self._holds -= 1

    def held_outside(self) -> bool:
        """Whether KV is reserved or pinned outside the scheduler's requests (the idle self-check
        would count it as leaked)."""
        return bool(self._reserved or self._holds)

    # --- request slots and KV slots -----------------------------------------------------------------
    def slots_for(self, req: Req, n: int, held: int | None = None) -> int:
        """KV slots (whole pages) ``req`` takes to grow by ``n`` tokens from ``held`` (its KV by default)."""
        cur = len(req.kv_indices) if held is None else held
        return self.allocator.pages_needed(cur, n) * self.page_size

    def admit(self, req: Req) -> None:
        """Give a newly admitted request a request slot and its cached prefix (already locked)."""
        if req.req_pool_idx is None:
            idx = self.req_to_token_pool.alloc()
            if idx is None:
                raise RuntimeError("no free request slot (max_running_requests exceeds the request pool)")
            req.req_pool_idx = idx
        req.kv_indices = list(req.prefix_indices)
        req.cache_protected_len = len(req.prefix_indices)
        self.req_to_token_pool.write(req.req_pool_idx, 0, req.kv_indices)
        if req.tier_hold is not None and self.tier is not None:
            self.tier.unhold(req)

    def grow(self, req: Req, n: int) -> list[int]:
        """KV slots for the next ``n`` tokens of ``req``, evicting cache leaves if needed."""
        self.windows.before_grow(req)
        last = req.kv_indices[-1] if req.kv_indices else None
        cur = len(req.kv_indices)
        need = self.allocator.pages_needed(cur, n) * self.page_size
        if need > self.allocator.available_size():
            self.tree_cache.evict(need - self.allocator.available_size())
        try:
            slots = self.allocator.alloc_extend(last, cur, n)
        except OutOfKVSlots as e:
            raise OutOfKVSlots(f"{e} (request {req.rid}: the budget check should have prevented this)") from e
        assert req.req_pool_idx is not None
        self.req_to_token_pool.write(req.req_pool_idx, cur, slots)
        req.kv_indices.extend(slots)
        return slots

    def grow_decode(self, reqs: list[Req]) -> tuple[list[int], list[int]]:
        """``grow(r, 1)`` for every request in order, in bulk: the same slots and the same cache
        evictions as the per-request calls, one request-table write. Returns ``(positions,
        slots)``: each request's computed length before the step, and its new slot."""
        ps = self.page_size
        if self.window is not None or self.window_kv is not None:
            for req in reqs:
                self.windows.before_grow(req)
        kvs = list(map(_get_kv_indices, reqs))  # (C passes: this runs for every running request)
        cols = list(map(len, kvs))
        if ps == 1:  # every request takes the next free slot
            slots = self.allocator.take_pages_in_turn(len(reqs), self.tree_cache.evict)
        else:
            pages = iter(self.allocator.take_pages_in_turn(sum(1 for c in cols if c % ps == 0),
                                                           self.tree_cache.evict))
            slots = [next(pages) * ps if c % ps == 0 else kv[-1] + 1 for kv, c in zip(kvs, cols, strict=True)]
        rows = list(map(_get_pool_idx, reqs))
        assert None not in rows
        deque(map(list.append, kvs, slots), maxlen=0)
        self.req_to_token_pool.write_many(rows, cols, slots)
        return cols, slots

    def decode_tokens_needed(self, reqs: list[Req], steps: int = 1) -> int:
        """Slots the running requests need for ``steps`` more decode steps."""
        ps = self.page_size
        if ps == 1:
            return len(reqs) * steps
        return sum(-(-(c + steps) // ps) - (c + ps - 1) // ps for c in [len(r.kv_indices) for r in reqs]) * ps

    def truncate(self, req: Req, n: int) -> None:
        """Keep only ``req``'s first ``n`` KV slots (speculative decoding: the positions of rejected
        drafts). Whole pages past the ``n``-th slot's page are freed; the rest of that page stays the
        request's, and its next ``grow`` writes over it. Never reaches into the cached prefix."""
        kv = req.kv_indices
        if n >= len(kv):
            return
        if n < req.cache_protected_len:
            raise ValueError(f"truncating request {req.rid} to {n} slots would cut its cached prefix "
                             f"({req.cache_protected_len})")
        if n < req.window_dropped_to:
            raise ValueError(f"truncating request {req.rid} to {n} slots would reach KV its sliding window "
                             f"no longer has ({req.window_dropped_to})")
        ps = self.page_size
        keep_pages = -(-n // ps) * ps
        if keep_pages < len(kv):
            self.allocator.free(kv[keep_pages:])
        del kv[n:]

    def keep_path(self, req: Req, first: int, path: list[int]) -> None:
        """Speculative decoding with a draft tree: ``req``'s drafts hold slots ``first, first + 1,
        ..`` in draft order; the kept ones (``path``, draft indices) move to the front, in path
        order, so that their KV sits at the positions they are kept at (the rest, now after them,
        is cut off by ``truncate``). Slots move, not KV: page size 1 only."""
        if self.page_size != 1:
            raise ValueError("draft trees need a page size of 1 (their kept slots move between positions)")
        kv = req.kv_indices
        tail = kv[first:]
        order = path + [j for j in range(len(tail)) if j not in set(path)]
        kv[first:] = [tail[j] for j in order]
        assert req.req_pool_idx is not None
        self.req_to_token_pool.write(req.req_pool_idx, first, kv[first:])

    def release(self, req: Req) -> None:
        """A request ends (or is retracted): its computed KV goes to the cache, the rest is freed."""
        if req.req_pool_idx is None:  # matched while waiting but never admitted: holds no lock
            req.last_node = None
            req.prefix_indices = ()
            if req.tier_hold is not None and self.tier is not None:
                self.tier.unhold(req)
            return
        self.windows.whole_prefix(req)
        self.windows.cache(req, self.tree_cache.cache_finished_req)
        req.window_dropped_to = 0

    def discard(self, req: Req) -> None:
        """A request whose forward failed: the KV allocated for that step was never written, so none
        of the request's own KV may reach the cache. Its own slots are freed, its prefix unlocked."""
        if req.req_pool_idx is None:
            self.release(req)
            return
        self.windows.whole_prefix(req)
        self.allocator.free(req.kv_indices[req.cache_protected_len :])
        if req.last_node is not None:
            self.tree_cache.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.window_dropped_to = 0
        req.kv_indices = []
        req.cache_protected_len = 0
        req.last_node = None

    def check_invariant(self, running: int = 0) -> None:
        """At idle: every KV slot is free or cached, nothing is locked, every request slot free."""
        avail = self.allocator.available_size()
        ev, prot = self.tree_cache.evictable_size(), self.tree_cache.protected_size()
        if avail + ev + prot != self.total_tokens:
            raise AssertionError(
                f"KV leak: available {avail} + evictable {ev} + protected {prot} != total {self.total_tokens}"
            )
        if prot != 0:
            raise AssertionError(f"{prot} cached tokens still locked at idle")
        if self.req_to_token_pool.available_size() != self.req_to_token_pool.size:
            raise AssertionError(
                f"request slot leak: {self.req_to_token_pool.size - self.req_to_token_pool.available_size()} in use at idle"
            )
        self.tree_cache.check_integrity()
        if self.window_kv is not None:
            self.window_kv.check(self.allocator.handed_out_pages())
        if self.tier is not None:
            self.tier.check()


_get_kv_indices = attrgetter("kv_indices")
_get_pool_idx = attrgetter("req_pool_idx")
