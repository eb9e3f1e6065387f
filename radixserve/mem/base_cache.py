"""The prefix-cache interface the scheduler programs against, and its locking contract.

Every KV slot is in exactly one of three places: free in the allocator, owned by a running request,
or owned by the cache. The cache's slots are either *evictable* (no running request uses them;
``evict`` may free them) or *protected* (a request holds a lock on a node whose path covers them).
At any idle moment::

    allocator.available_size() + cache.evictable_size() + cache.protected_size() == total slots

Contract:
- ``match_prefix(key)`` finds the longest cached prefix. It may split a node so the match ends on
  a node boundary, which changes no size, and it refreshes access times; it never locks.
- ``inc_lock_ref(node)`` pins the path root..node against eviction (evictable -> protected);
  ``dec_lock_ref(node)`` undoes exactly one inc.
- ``insert(key, value)`` adds a path and returns how many leading tokens were already cached: the
  caller still owns ``value[:that]`` (duplicates of what the tree has) and must free the part it
  does not already hold through a lock. New nodes start unlocked (evictable). (With sliding-window
  layers' own slots, a duplicate's window page moves to the cached slot that lacks one: window_kv.py.)
- ``evict(n)`` frees at least ``n`` slots if it can, unlocked leaves first, in the order of the
  eviction strategy; it returns what it freed.
- ``cache_finished_req`` / ``cache_unfinished_req`` hand a request's KV to the cache at the end of
  a request or of a prefill chunk, free duplicates and update the request's lock.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from array import array
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from radixserve.mem.allocator import TokenToKVPoolAllocator
from radixserve.mem.kv_pool import ReqToTokenPool
from radixserve.mem.tree_node import TreeNode


@dataclass(frozen=True)
class RadixKey:
    """Token ids namespaced by ``extra_key`` (a LoRA id, a cache salt): different namespaces never
    share nodes."""

    token_ids: list[int] | tuple[int, ...]
    extra_key: str | None = None

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass
class MatchResult:
    device_indices: array[int]  # KV slots of the matched prefix (int64)
    last_node: TreeNode | None  # node whose path ends where the match ends (the root; None without a tree)


class CacheableReq(Protocol):
    """What the cache needs of a request (``sched.Req`` provides it)."""

    req_pool_idx: int | None
    kv_indices: list[int]  # KV slot of each computed token, in order
    cache_protected_len: int  # leading kv_indices owned by the cache (pinned by last_node)
    last_node: TreeNode | None
    extra_key: str | None

    @property
    def kv_token_ids(self) -> list[int]: ...  # token ids whose KV is in kv_indices


class BasePrefixCache(ABC):
    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator: TokenToKVPoolAllocator) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.page_size = allocator.page_size

    @abstractmethod
    def reset(self) -> None: ...

    @abstractmethod
    def match_prefix(self, key: RadixKey) -> MatchResult: ...

    @abstractmethod
    def insert(self, key: RadixKey, value: list[int]) -> int: ...

    @abstractmethod
    def inc_lock_ref(self, node: TreeNode | None) -> int: ...

    @abstractmethod
    def dec_lock_ref(self, node: TreeNode | None) -> int: ...

    @abstractmethod
    def evict(self, num_tokens: int) -> int: ...

    @abstractmethod
    def evictable_size(self) -> int: ...

    @abstractmethod
    def protected_size(self) -> int: ...

    def total_size(self) -> int:
        return self.evictable_size() + self.protected_size()

    @property
    @abstractmethod
    def root(self) -> Any: ...

    @abstractmethod
    def cache_finished_req(self, req: CacheableReq) -> None: ...

    @abstractmethod
    def cache_unfinished_req(self, req: CacheableReq) -> None: ...

    # --- read-only questions the scheduler's rules ask; a cache that shares nothing answers "none"
    def peek_prefix_len(self, key: RadixKey) -> int:
        """Length of the longest cached prefix of ``key`` without touching the cache (no split, no
        access time, no lock): what ordering and admission estimates need."""
        return 0

    def exclusive_locked_tokens(self, node: TreeNode | None) -> int:
        """Cached tokens on ``node``'s path that only one request pins: evictable once it lets go."""
        return 0

    def mark_wanted(self, keys: Iterable[RadixKey]) -> None:  # noqa: B027 - nothing to keep without a tree
        """Hint that the cached prefixes of ``keys`` (waiting requests) are wanted soon: an eviction
        strategy that honours it evicts them last."""

    def check_integrity(self) -> None:  # noqa: B027 - optional for caches without structure
        """Raise if internal bookkeeping disagrees with itself."""

    def _release(self, req: CacheableReq) -> None:
        if req.req_pool_idx is not None:
            self.req_to_token_pool.free(req.req_pool_idx)
            req.req_pool_idx = None
        req.kv_indices = []
        req.cache_protected_len = 0
        req.last_node = None


class ChunkCache(BasePrefixCache):
    """``--disable-radix-cache``: nothing is shared; a request's KV is freed when it ends."""

    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator: TokenToKVPoolAllocator) -> None:
        super().__init__(req_to_token_pool, allocator)
        self._root = None  # no tree

    @property
    def root(self) -> Any:
        return self._root

    def reset(self) -> None:
        pass

    def match_prefix(self, key: RadixKey) -> MatchResult:
        return MatchResult(array("q"), None)  # no tree: no node to pin

    def insert(self, key: RadixKey, value: list[int]) -> int:
        return 0

    def inc_lock_ref(self, node: TreeNode | None) -> int:
        return 0

    def dec_lock_ref(self, node: TreeNode | None) -> int:
        return 0

    def evict(self, num_tokens: int) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def cache_finished_req(self, req: CacheableReq) -> None:
        self.allocator.free(req.kv_indices)
        self._release(req)

    def cache_unfinished_req(self, req: CacheableReq) -> None:
        pass
