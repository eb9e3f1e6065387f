"""``TreeNode``: one node of the radix tree (a run of token ids and the KV slots holding them), and
the key comparison the tree's walks share. ``radix_cache`` builds and changes trees of them;
``radix_walks`` reads them."""

from __future__ import annotations

from array import array
from typing import Any

END = object()  # watch key of a match that covered its whole key: only an eviction can change it


class TreeNode:
    __slots__ = (
        "children", "parent", "key", "value", "lock_ref", "last_access_time", "hit_count", "extra_key", "id", "gen",
        "heap_stamp", "watchers",
    )

    _next_id = 0

    def __init__(self, parent: TreeNode | None = None, extra_key: str | None = None) -> None:
        self.children: dict[Any, TreeNode] = {}
        self.parent = parent
        self.key: list[int] = []
        self.value: array[int] = array("q")  # the KV slots, as one block the allocator frees in bulk
        self.lock_ref = 0
        self.last_access_time = 0
        self.hit_count = 0
        self.extra_key = extra_key
        TreeNode._next_id += 1
        self.id = TreeNode._next_id
        # bumped whenever a child is added or removed; -1 once the node itself is evicted. Lets a
        # reader cache "the match stopped at this node" and know when to look again (sched.policies.prefix_match).
        self.gen = 0
        self.heap_stamp = 0  # only the LeafHeap entry carrying the latest stamp is live
        self.watchers: dict[Any, list[Any]] | None = None  # watch key -> tokens (RadixCache.watch)

    def __lt__(self, other: TreeNode) -> bool:  # heap tie-break: stable and deterministic
        return self.id < other.id

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock={self.lock_ref})"


def match_len(a: list[int] | tuple[int, ...], b: list[int] | tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the common case, compared in C
        return n
    lo, hi = 0, n  # the first mismatch lies in [lo, hi)
    while hi - lo > 16:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    while a[lo] == b[lo]:
        lo += 1
    return lo


def fire(node: TreeNode, key: Any) -> None:
    """Invalidate the watchers of ``node``'s child slot ``key`` (``RadixCache.watch``)."""
    w = node.watchers
    if w:
        lst = w.pop(key, None)
        if lst:
            for t in lst:
                t.invalidate()


def fire_all(node: TreeNode) -> None:
    """Invalidate every watcher of ``node`` (it is going)."""
    w = node.watchers
    if w:
        node.watchers = None
        for lst in w.values():
            for t in lst:
                t.invalidate()


def path_of(node: TreeNode) -> list[int]:
    """The tokens from the root to the end of ``node``."""
    keys: list[list[int]] = []
    n: TreeNode | None = node
    while n is not None and n.parent is not None:
        keys.append(n.key)
        n = n.parent
    out: list[int] = []
    for k in reversed(keys):
        out.extend(k)
    return out
