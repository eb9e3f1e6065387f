"""Read-only walks over a ``RadixCache`` that the scheduler's rules need: the tokens only one
request pins (preemption cost), the live ancestor of an evicted match (lpm's incremental matches),
``dfs-weight``'s traversal, and the queue-aware eviction marks. They use the cache's public API
only, so ``radix_cache.py`` stays the tree's own operations."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

from radixserve.mem.evict_policy import QueueAwareStrategy
from radixserve.mem.radix_cache import RadixCache, TreeNode

T = TypeVar("T")


def exclusive_locked_tokens(tree: RadixCache, node: TreeNode | None) -> int:
    """Cached tokens on ``node``'s path that only one request pins (``lock_ref`` 1, from ``node``
    up): what becomes evictable once that request lets go."""
    n = 0
    root = tree.root
    while node is not None and node is not root and node.lock_ref == 1:
        n += len(node.key)
        node = node.parent
    return n


def live_ancestor(node: TreeNode, pos: int) -> tuple[TreeNode, int]:
    """A match that ended at ``node`` after ``pos`` tokens, moved back to the nearest node still in
    the tree (evicted nodes have ``gen`` -1), with the tokens up to it."""
    while node.gen < 0:
        pos -= len(node.key)
        assert node.parent is not None
        node = node.parent
    return node, pos


def weighted_dfs(tree: RadixCache, at: dict[TreeNode, list[T]]) -> list[T]:
    """The items ``at`` hangs on nodes, depth first from the root, heavier subtrees first (a subtree
    weighs the items hung in it; ties keep the tree's child order), a node's own items after its
    subtree's: ``dfs-weight``'s order."""
    root = tree.root
    weight: dict[TreeNode, int] = {}
    for start, items in at.items():  # each node's count goes to it and every ancestor
        node: TreeNode | None = start
        while node is not None:
            weight[node] = weight.get(node, 0) + len(items)
            if node is root:
                break
            node = node.parent
    out: list[T] = []
    stack: list[tuple[TreeNode, bool]] = [(root, False)]
    while stack:
        node_, expanded = stack.pop()
        if expanded:
            out.extend(at.get(node_, ()))
            continue
        stack.append((node_, True))
        kids = [c for c in node_.children.values() if c in weight]  # weight-0 subtrees hold no item
        kids.sort(key=lambda c: -weight[c])  # stable: equal weights keep the tree's order
        stack.extend((c, False) for c in reversed(kids))
    return out


def mark_wanted(tree: RadixCache, prefixes: Iterable[tuple[list[int], str | None]]) -> None:
    """Under the queue-aware eviction strategy: the nodes on the cached paths of ``prefixes`` (the
    waiting requests' tokens and extra keys) are evicted after every other leaf. When a match ends
    inside a child, that child is wanted too. A no-op under other strategies."""
    strategy = tree.strategy
    if not isinstance(strategy, QueueAwareStrategy):
        return
    wanted: set[int] = set()
    root = tree.root
    for ids, extra_key in prefixes:
        node, pos, length = tree.peek_prefix(ids, extra_key)
        if length > pos:
            child = node.children.get(tree.child_key(node, ids[pos:], extra_key))
            if child is not None:
                wanted.add(child.id)
        n: TreeNode | None = node
        while n is not None and n is not root and n.id not in wanted:
            wanted.add(n.id)
            n = n.parent
    strategy.wanted = wanted
