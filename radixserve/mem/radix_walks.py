"""Read-only walks over a radix tree's nodes: the tokens only one request pins (preemption cost),
the live ancestor of an evicted match (lpm's incremental matches), ``dfs-weight``'s traversal, and
the tally the integrity check compares with the tree's kept sizes. They read ``TreeNode``s only,
so ``radix_cache.py`` stays the tree's own operations."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from radixserve.mem.tree_node import TreeNode, match_len

T = TypeVar("T")


def exclusive_locked_tokens(node: TreeNode | None) -> int:
    """Cached tokens on ``node``'s path that only one request pins (``lock_ref`` 1, from ``node``
    up to the root, which has no parent): what becomes evictable once that request lets go."""
    n = 0
    while node is not None and node.parent is not None and node.lock_ref == 1:
        n += len(node.key)
        node = node.parent
    return n


def peek(root: TreeNode, ids: list[int] | tuple[int, ...], extra_key: str | None, page_size: int,
         node: TreeNode | None = None, pos: int = 0, limit: int | None = None) -> tuple[TreeNode, int, int]:
    """The longest cached prefix of ``ids[:limit]`` in the tree at ``root``, read-only: no split, no
    access-time update, no lock (what a policy needs to *order* requests). Resumes from ``node``
    when given, whose path must spell ``ids[:pos]``. Returns ``(node, pos, length)``: the deepest
    node matched whole, the length of its path, and the match length, which may run into one of its
    children (the page-aligned length ``match_prefix`` would return)."""
    if isinstance(ids, tuple):
        ids = list(ids)  # node keys are lists: slices must compare equal to them
    ps = page_size
    end = len(ids) if limit is None else min(limit, len(ids))
    end -= end % ps
    if node is None:
        node, pos = root, 0
    while pos < end:
        first: Any = ids[pos] if ps == 1 else tuple(ids[pos : pos + ps])
        child = node.children.get((extra_key, first) if node is root else first)
        if child is None:
            break
        klen = len(child.key)
        if pos + klen <= end and ids[pos : pos + klen] == child.key:
            node = child
            pos += klen
            continue
        n = match_len(child.key, ids[pos : min(pos + klen, end)])
        return node, pos, pos + n - n % ps
    return node, pos, pos


def wanted_ids(root: TreeNode, keys: Iterable[tuple[Sequence[int], str | None]],
               child_key: Callable[[TreeNode, list[int], str | None], Any], page_size: int) -> set[int]:
    """The ids of the nodes on the cached paths of ``keys`` (token ids, extra key), and of the child
    a match ends inside (``RadixCache.mark_wanted``)."""
    wanted: set[int] = set()
    for ids, extra_key in keys:
        node, pos, length = peek(root, list(ids), extra_key, page_size)
        if length > pos:
            child = node.children.get(child_key(node, list(ids[pos:]), extra_key))
            if child is not None:
                wanted.add(child.id)
        n: TreeNode | None = node
        while n is not None and n.parent is not None and n.id not in wanted:
            wanted.add(n.id)
            n = n.parent
    return wanted


def live_ancestor(node: TreeNode, pos: int) -> tuple[TreeNode, int]:
    """A match that ended at ``node`` after ``pos`` tokens, moved back to the nearest node still in
    the tree (evicted nodes have ``gen`` -1), with the tokens up to it."""
    while node.gen < 0:
        pos -= len(node.key)
        assert node.parent is not None
        node = node.parent
    return node, pos


def weighted_dfs(root: TreeNode, at: dict[TreeNode, list[T]]) -> list[T]:
    """The items ``at`` hangs on nodes, depth first from the root, heavier subtrees first (a subtree
    weighs the items hung in it; ties keep the tree's child order), a node's own items after its
    subtree's: ``dfs-weight``'s order."""
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


def tally(root: TreeNode, child_key: Callable[[TreeNode, list[int], str | None], Any],
          page_size: int) -> tuple[int, int, set[TreeNode]]:
    """Walk the whole tree checking its structure (parents, child keys, key/value lengths, page
    alignment, locks never growing downwards); returns the evictable and protected token counts
    and the set of evictable leaves, for the tree to compare with what it keeps."""
    evictable = protected = 0
    leaves: set[TreeNode] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        for ck, child in node.children.items():
            if child.parent is not node:
                raise AssertionError(f"{child} has a wrong parent")
            if child_key(node, child.key, child.extra_key) != ck:
                raise AssertionError(f"{child} filed under a wrong key")
            if len(child.key) != len(child.value) or not child.key:
                raise AssertionError(f"{child} key/value lengths differ or are empty")
            if page_size > 1 and len(child.key) % page_size:
                raise AssertionError(f"{child} is not page aligned")
            if child.lock_ref > node.lock_ref and node is not root:
                raise AssertionError(f"{child} is locked more than its parent")
            if child.lock_ref == 0:
                evictable += len(child.key)
            else:
                protected += len(child.key)
            if child.lock_ref == 0 and not child.children:
                leaves.add(child)
            stack.append(child)
    return evictable, protected, leaves


def all_values(root: TreeNode) -> list[int]:
    """Every KV slot the tree below ``root`` owns."""
    out: list[int] = []
    stack = [root]
    while stack:
        node = stack.pop()
        out.extend(node.value)
        stack.extend(node.children.values())
    return out


def pretty(root: TreeNode) -> str:
    """The tree as indented lines (first tokens, length, lock count), for debugging."""
    lines: list[str] = []
    stack: list[tuple[TreeNode, int]] = [(c, 0) for c in reversed(root.children.values())]
    while stack:
        node, depth = stack.pop()
        lines.append(f"{'  ' * depth}{node.key[:8]}{'...' if len(node.key) > 8 else ''} "
                     f"len={len(node.key)} lock={node.lock_ref}")
        stack.extend((c, depth + 1) for c in reversed(node.children.values()))
    return "\n".join(lines)
