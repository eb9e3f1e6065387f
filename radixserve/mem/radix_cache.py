"""``RadixCache``: a radix tree of token ids whose nodes own the KV slots of their tokens.

A node's ``key`` is a run of token ids and its ``value`` the KV slots holding them (an int64
``array``, so an eviction hands the allocator its slots as one block); the path from
the root to a node spells a cached prefix. Children are keyed by their first token (first page
when ``page_size > 1``); children of the root also carry the ``extra_key`` namespace, so two
namespaces never share a node. With pages, keys are cut to whole pages: a partial page is never
cached, so a match always ends on a page boundary and a request's own pages start fresh after it.

Sizes: every node's tokens count once, as evictable (``lock_ref == 0``) or protected. A lock on a
node pins its whole path, so ``lock_ref`` never decreases going up the tree.

Eviction frees unlocked leaves in the order the eviction strategy gives (LRU by default); a parent
whose last child went becomes a leaf and a candidate in turn. The set of evictable leaves is kept
up to date on every change, and so is a heap of them in eviction order (``leaf_heap.LeafHeap``),
so ``evict`` never walks the whole tree.

Watchers (``watch``): a reader that matched a key against the tree (``peek_prefix``) and stopped
at node N before the child slot K can register a token there; ``token.invalidate()`` is called
when that answer may change: a child is added under N at K, the child at K is split or evicted,
or N itself is evicted (every token on N), or the tree is reset. ``sched.prefix_match`` keeps
lpm's cached prefix lengths this way, so a queue of waiting requests is not re-matched each round.

Cache events (``event_sink``, off by default): when set, the tree reports what it now stores and
what it evicted as ``cache_events`` records (a new path on ``insert``, each evicted leaf, a
``reset``), for a worker to publish to the router. Unset, each hook is one attribute test.

Tier hooks (each None by default): the KV tier behind the tree (``sched.kv_tiering``) sets the one
its write policy needs, to hear of each new leaf (``on_new_leaf``), each node a match passes
through (``on_hit``), or each node about to be evicted while its slots still hold its KV and its
path is still in the tree (``on_evicting``).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable
from typing import Any

from radixserve.mem.allocator import TokenToKVPoolAllocator
from radixserve.mem.base_cache import BasePrefixCache, CacheableReq, MatchResult, RadixKey
from radixserve.mem.cache_events import AllCleared, BlockRemoved, BlockStored, CacheEvent
from radixserve.mem.evict_policy import EvictionStrategy, QueueAwareStrategy, get_eviction_strategy
from radixserve.mem.kv_pool import ReqToTokenPool
from radixserve.mem.leaf_heap import LeafHeap
from radixserve.mem.radix_walks import all_values, exclusive_locked_tokens, peek, pretty, tally, wanted_ids
from radixserve.mem.tree_node import TreeNode, fire, fire_all, match_len, path_of


class RadixCache(BasePrefixCache):
    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        allocator: TokenToKVPoolAllocator,
        eviction_policy: str | EvictionStrategy = "lru",
        event_sink: Callable[[CacheEvent], None] | None = None,
    ) -> None:
        super().__init__(req_to_token_pool, allocator)
        self.event_sink: Callable[[CacheEvent], None] | None = None
        self.on_new_leaf: Callable[[TreeNode], None] | None = None
        self.on_hit: Callable[[TreeNode], None] | None = None
        self.on_evicting: Callable[[TreeNode], None] | None = None
        self._leaves: set[TreeNode] = set()
        self._strategy = (
            get_eviction_strategy(eviction_policy) if isinstance(eviction_policy, str) else eviction_policy
        )
        self._heap = LeafHeap(self._strategy, self._leaves)
        self.evicted_tokens = 0  # since start; a flush (which evicts everything) counts too
        self.evicted_nodes = 0
        self.reset()
        # receives a ``CacheEvent`` for each change of the default namespace's cached paths (see
        # cache_events) from now on (not the empty tree's first reset); None: nothing is reported
        self.event_sink = event_sink

    @property
    def strategy(self) -> EvictionStrategy:
        return self._strategy

    @strategy.setter
    def strategy(self, strategy: EvictionStrategy) -> None:
        self._strategy = strategy
        self._heap = LeafHeap(strategy, self._leaves)
        self._heap.rebuild()

    # --- bookkeeping ---------------------------------------------------------------------------
    def reset(self) -> None:
        old = getattr(self, "_root", None)
        if old is not None:
            self._kill(old)
        self._root = TreeNode()
        self._root.lock_ref = 1  # the root is never evicted
        self._evictable = 0
        self._protected = 0
        self._clock = 0
        self._leaves.clear()  # unlocked, childless, non-root nodes
        self._heap.rebuild()
        # bumped when a node is added or evicted (not on a split, which changes no match length)
        self.version = getattr(self, "version", 0) + 1
        if self.event_sink is not None:
            self.event_sink(AllCleared())

    @property
    def root(self) -> TreeNode:
        return self._root

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _refresh_leaf(self, node: TreeNode) -> None:
        if node is not self._root and node.lock_ref == 0 and not node.children:
            if node not in self._leaves:
                self._leaves.add(node)
                self._heap.push(node)
        else:
            self._leaves.discard(node)

    # --- watchers --------------------------------------------------------------------------------
    def watch(self, node: TreeNode, key: Any, token: Any) -> None:
        """Call ``token.invalidate()`` once when the child slot ``key`` of ``node`` changes or
        ``node`` goes (``key`` is ``child_key`` of the next token, or ``END``)."""
        w = node.watchers
        if w is None:
            node.watchers = {key: [token]}
            return
        lst = w.get(key)
        if lst is None:
            w[key] = [token]
        else:
            lst.append(token)

    def _kill(self, root: TreeNode) -> None:
        """A reset: every node of the old tree is gone for its watchers."""
        stack = [root]
        while stack:
            node = stack.pop()
            node.gen = -1
            fire_all(node)
            stack.extend(node.children.values())

    def child_key(self, node: TreeNode, key: list[int] | tuple[int, ...], extra_key: str | None) -> Any:
        """The key under which ``node`` holds the child that ``key`` (the tokens after ``node``) starts."""
        first: Any = key[0] if self.page_size == 1 else tuple(key[: self.page_size])
        return (extra_key, first) if node is self._root else first

    def _aligned(self, key: RadixKey) -> list[int] | tuple[int, ...]:
        ids = key.token_ids
        if self.page_size > 1:
            ids = ids[: len(ids) // self.page_size * self.page_size]
        return ids

    # --- match / insert --------------------------------------------------------------------------
    def match_prefix(self, key: RadixKey) -> MatchResult:
        ids = self._aligned(key)
        node = self._root
        now = self._tick()
        node.last_access_time = now
        indices: array[int] = array("q")  # the nodes' slot blocks copied end to end, no int objects made
        pos = 0
        while pos < len(ids):
            child = node.children.get(self.child_key(node, ids[pos : pos + self.page_size], key.extra_key))
            if child is None:
                break
            n = self._page_floor(match_len(child.key, ids[pos : pos + len(child.key)]))
            child.last_access_time = now
            child.hit_count += 1
            if n < len(child.key):
                if n == 0:
                    break
                node = self._split(child, n)
                indices.extend(node.value)
                if self.on_hit is not None:
                    self.on_hit(node)
                break
            if self.on_hit is not None:
                self.on_hit(child)
            indices.extend(child.value)
            node = child
            pos += n
        return MatchResult(indices, node)

    def _page_floor(self, n: int) -> int:
        return n - n % self.page_size

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut ``child`` after ``n`` tokens; returns the new upper node (same locks, same sizes)."""
        parent = child.parent
        assert parent is not None
        upper = TreeNode(parent, child.extra_key)
        upper.key, upper.value = child.key[:n], child.value[:n]
        upper.lock_ref = child.lock_ref
        upper.last_access_time = child.last_access_time
        upper.hit_count = child.hit_count
        ck = self.child_key(parent, child.key, child.extra_key)
        parent.children[ck] = upper
        fire(parent, ck)
        child.key, child.value = child.key[n:], child.value[n:]
        child.parent = upper
        upper.children[self.child_key(upper, child.key, child.extra_key)] = child
        return upper

    def insert(self, key: RadixKey, value: list[int]) -> int:
        ids = self._aligned(key)
        if len(value) < len(ids):
            raise ValueError("insert: fewer values than key tokens")
        node = self._root
        now = self._tick()
        pos = 0
        while pos < len(ids):
            ck = self.child_key(node, ids[pos : pos + self.page_size], key.extra_key)
            child = node.children.get(ck)
            if child is None:
                leaf = TreeNode(node, key.extra_key)
                leaf.key, leaf.value = list(ids[pos:]), array("q", value[pos : len(ids)])
                leaf.last_access_time = now
                node.children[ck] = leaf
                node.gen += 1
                fire(node, ck)
                self.version += 1
                self._evictable += len(leaf.key)
                self._refresh_leaf(node)
                self._refresh_leaf(leaf)
                if self.event_sink is not None and key.extra_key is None:
                    self.event_sink(BlockStored(list(ids), pos))
                if self.on_new_leaf is not None:
                    self.on_new_leaf(leaf)
                return pos
            n = self._page_floor(match_len(child.key, ids[pos : pos + len(child.key)]))
            child.last_access_time = now
            if n < len(child.key):
                child = self._split(child, n)
            if self.allocator.window_kv is not None:  # the duplicates' sliding-window pages, kept
                self.allocator.window_kv.adopt(child.value, value[pos : pos + n])
            node = child
            pos += n
        return pos

    def peek_prefix(
        self, ids: list[int], extra_key: str | None = None, node: TreeNode | None = None, pos: int = 0,
        limit: int | None = None,
    ) -> tuple[TreeNode, int, int]:
        """The longest cached prefix of ``ids[:limit]``, read-only (``radix_walks.peek``)."""
        return peek(self._root, ids, extra_key, self.page_size, node, pos, limit)

    def peek_prefix_len(self, key: RadixKey) -> int:
        return peek(self._root, key.token_ids, key.extra_key, self.page_size)[2]

    def exclusive_locked_tokens(self, node: TreeNode | None) -> int:
        return exclusive_locked_tokens(node)

    def mark_wanted(self, keys: Iterable[RadixKey]) -> None:
        """Under the queue-aware eviction strategy: the nodes on the cached paths of ``keys`` are
        evicted after every other leaf. When a match ends inside a child, that child is wanted too.
        A no-op under other strategies."""
        strategy = self._strategy
        if not isinstance(strategy, QueueAwareStrategy):
            return
        strategy.wanted = wanted_ids(self._root, ((k.token_ids, k.extra_key) for k in keys), self.child_key,
                                     self.page_size)

    # --- locks ---------------------------------------------------------------------------------
    def inc_lock_ref(self, node: TreeNode | None) -> int:
        delta = 0
        while node is not None and node is not self._root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
                delta -= len(node.key)
                self._leaves.discard(node)
            node.lock_ref += 1
            assert node.parent is not None
            node = node.parent
        return delta

    def dec_lock_ref(self, node: TreeNode | None) -> int:
        delta = 0
        while node is not None and node is not self._root:
            if node.lock_ref <= 0:
                raise RuntimeError(f"dec_lock_ref on unlocked {node}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
                delta += len(node.key)
                self._refresh_leaf(node)
            assert node.parent is not None
            node = node.parent
        return delta

    # --- eviction ------------------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        if num_tokens <= 0 or not self._leaves:
            return 0
        slots = array("q")  # every evicted node's slots, freed in one call
        evicting = self.on_evicting
        for node in self._heap.pop_order():  # a parent left childless is pushed by _delete_leaf
            if evicting is not None:
                evicting(node)
            slots.extend(node.value)
            self._delete_leaf(node)
            self.evicted_nodes += 1
            if len(slots) >= num_tokens:
                break
        self.allocator.free(slots)
        self.evicted_tokens += len(slots)
        return len(slots)

    def _delete_leaf(self, node: TreeNode) -> None:
        parent = node.parent
        assert parent is not None
        if self.event_sink is not None and node.extra_key is None:
            path = path_of(node)
            self.event_sink(BlockRemoved(path, len(path) - len(node.key)))
        ck = self.child_key(parent, node.key, node.extra_key)
        del parent.children[ck]
        fire(parent, ck)
        fire_all(node)
        parent.gen += 1
        node.gen = -1
        self.version += 1
        self._evictable -= len(node.key)
        self._leaves.discard(node)
        self._refresh_leaf(parent)

    # --- requests ------------------------------------------------------------------------------
    def cache_finished_req(self, req: CacheableReq) -> None:
        """Give a finished (or retracted) request's computed KV to the tree and release the request.

        ``kv_indices`` of the request, by region::

            [0, protected)        the tree's already (pinned by last_node): nothing to do
            [protected, dup_end)  computed here, but someone inserted the same tokens meanwhile: free
            [dup_end, aligned)    new to the tree: now owned by it (evictable)
            [aligned, len)        a partial trailing page: free
        """
        kv = req.kv_indices
        aligned = len(kv) - len(kv) % self.page_size
        dup_end = self.insert(RadixKey(req.kv_token_ids[:aligned], req.extra_key), kv[:aligned])
        self.allocator.free(kv[req.cache_protected_len : dup_end])
        self.allocator.free(kv[aligned:])
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)
        self._release(req)

    def cache_unfinished_req(self, req: CacheableReq) -> None:
        """After a prefill chunk: cache what was computed so far and move the request's lock down.

        The request keeps its KV, but the slots of tokens the tree already had (inserted by
        someone else) are swapped for the tree's and its own copies are freed.
        """
        kv = req.kv_indices
        aligned = len(kv) - len(kv) % self.page_size
        key = RadixKey(req.kv_token_ids[:aligned], req.extra_key)
        dup_end = self.insert(key, kv[:aligned])
        self.allocator.free(kv[req.cache_protected_len : dup_end])
        match = self.match_prefix(key)
        new = match.device_indices
        assert len(new) == aligned, (len(new), aligned)
        start = req.cache_protected_len
        if req.req_pool_idx is not None and dup_end > start:
            self.req_to_token_pool.write(req.req_pool_idx, start, new[start:dup_end])
        kv[:aligned] = new
        self.inc_lock_ref(match.last_node)
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)
        req.last_node = match.last_node
        req.cache_protected_len = aligned

    # --- checks & views ------------------------------------------------------------------------
    def check_integrity(self) -> None:
        evictable, protected, leaves = tally(self._root, self.child_key, self.page_size)
        if (evictable, protected) != (self._evictable, self._protected):
            raise AssertionError(
                f"sizes drifted: counted evictable={evictable} protected={protected}, "
                f"kept {self._evictable}/{self._protected}"
            )
        if leaves != self._leaves:
            raise AssertionError("the evictable-leaf set drifted")
        self._heap.check()

    def all_values(self) -> list[int]:
        return all_values(self._root)

    def pretty(self) -> str:
        return pretty(self._root)
