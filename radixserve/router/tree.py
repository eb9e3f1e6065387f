"""``PrefixTree``: the router's approximate radix tree of which worker holds which prefix.

One tree for all workers. A node holds a run of the key (characters of the prompt text, or token
ids when the router tokenizes) and the set of *tenants*, the routing targets that were sent a
request through that node, each with the logical time it was last used:

    root
     └─ "You are a helpful assistant. "          {w0: 7, w1: 9}
          ├─ "What is the capital of France?"    {w0: 7}
          └─ "Translate to German: cat"          {w1: 9}

Invariant: a tenant on a node is on every ancestor of it too (a path is inserted whole), so the
length a tenant matches is the depth of the deepest node on the key's path that still lists it,
and a tenant's size (``tenant_size``) is the sum of the key lengths of the nodes that list it.

Bounded by LRU eviction per tenant (``evict``): while a tenant holds more than ``max_size``
elements, its least recently used *tenant-leaf* (a node that lists it while no child does) drops
it; a node that no tenant lists any more is removed. ``remove`` drops a tenant from the part of a
path past a given length: what a worker's cache-eviction event says.

Pure data structure: no clock (times are the caller's logical ticks), no I/O, no threads.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from typing import Any

Key = Sequence[Any]  # a str, or a sequence of token ids


class _Node:
    __slots__ = ("key", "children", "parent", "tenants")

    def __init__(self, key: Key, parent: _Node | None) -> None:
        self.key = key
        self.children: dict[Any, _Node] = {}
        self.parent = parent
        self.tenants: dict[str, int] = {}  # tenant -> logical time of last use


def _common(a: Key, b: Key, start: int) -> int:
    """Length of the common prefix of ``a`` and ``b[start:]``."""
    n = min(len(a), len(b) - start)
    i = 0
    while i < n and a[i] == b[start + i]:
        i += 1
    return i


class PrefixTree:
    def __init__(self) -> None:
        self.root = _Node(key="", parent=None)
        self._sizes: dict[str, int] = {}
        self._tick = 0

    # --- queries ---------------------------------------------------------------------------------
    def tenant_size(self, tenant: str) -> int:
        return self._sizes.get(tenant, 0)

    def tenants(self) -> list[str]:
        return list(self._sizes)

    def match(self, key: Key) -> tuple[int, dict[str, int]]:
        """(length matched by the tree, {tenant: length it matches}) for every tenant on the path.

        The tree's length is the longest any tenant matches; a partly matched node counts for the
        elements that match, as in sgl-router."""
        node, pos = self.root, 0
        per: dict[str, int] = {}
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            n = _common(child.key, key, pos)
            pos += n
            for t in child.tenants:
                per[t] = pos
            if n < len(child.key):
                break
            node = child
        return (max(per.values()) if per else 0), per

    # --- updates ---------------------------------------------------------------------------------
    def insert(self, key: Key, tenant: str) -> None:
        """Record that ``tenant`` holds all of ``key``; refreshes the LRU time of the whole path."""
        self._tick += 1
        now = self._tick
        sizes = self._sizes
        sizes.setdefault(tenant, 0)
        node, pos = self.root, 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                leaf = _Node(key[pos:], node)
                node.children[key[pos]] = leaf
                leaf.tenants[tenant] = now
                sizes[tenant] += len(leaf.key)
                return
            n = _common(child.key, key, pos)
            if n < len(child.key):
                child = self._split(child, n)
            if tenant not in child.tenants:
                sizes[tenant] += len(child.key)
            child.tenants[tenant] = now
            pos += n
            node = child

    def _split(self, child: _Node, n: int) -> _Node:
        """Cut ``child`` after ``n`` elements; returns the new upper half (same tenants)."""
        parent = child.parent
        assert parent is not None
        upper = _Node(child.key[:n], parent)
        upper.tenants = dict(child.tenants)
        parent.children[child.key[0]] = upper
        child.key = child.key[n:]
        child.parent = upper
        upper.children[child.key[0]] = child
        return upper

    def remove(self, key: Key, tenant: str, keep: int = 0) -> int:
        """Drop ``tenant`` from the part of ``key``'s path past ``keep`` elements (and from anything
        below it). Returns how many elements the tenant lost. For a worker's eviction events."""
        node, pos = self.root, 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None or tenant not in child.tenants:
                return 0
            n = _common(child.key, key, pos)
            if pos + len(child.key) <= keep:  # wholly kept: walk on
                if n < len(child.key):
                    return 0  # the key leaves the tree before reaching keep
                pos += n
                node = child
                continue
            if keep > pos:  # the cut falls inside this node: keep its upper part
                if n <= keep - pos:  # the key leaves this node at or before keep: none of it is ours
                    return 0
                self._split(child, keep - pos)
            return self._drop_subtree(child, tenant)
        return 0

    def remove_tenant(self, tenant: str) -> None:
        """Forget a tenant altogether (a worker left the fleet)."""
        for child in list(self.root.children.values()):
            self._drop_subtree(child, tenant)
        self._sizes.pop(tenant, None)

    def _drop_subtree(self, top: _Node, tenant: str) -> int:
        lost = 0
        stack = [top]
        while stack:
            node = stack.pop()
            if node.tenants.pop(tenant, None) is None:
                continue
            lost += len(node.key)
            stack.extend(node.children.values())
            self._prune(node)
        if tenant in self._sizes:
            self._sizes[tenant] -= lost
        return lost

    def _prune(self, node: _Node) -> None:
        """Remove ``node`` if no tenant lists it (its subtree is then empty of tenants too)."""
        if node.tenants or node.parent is None:
            return
        if node.parent.children.get(node.key[0]) is node:
            del node.parent.children[node.key[0]]
        node.parent = None

    def evict(self, max_size: int) -> int:
        """LRU-evict every tenant down to ``max_size`` elements; returns the elements evicted."""
        total = 0
        for tenant, size in list(self._sizes.items()):
            if size > max_size:
                total += self._evict_tenant(tenant, max_size)
        return total

    def _evict_tenant(self, tenant: str, max_size: int) -> int:
        heap = [(n.tenants[tenant], id(n), n) for n in self._tenant_leaves(tenant)]
        heapq.heapify(heap)
        evicted = 0
        while heap and self._sizes[tenant] > max_size:
            _, _, node = heapq.heappop(heap)
            del node.tenants[tenant]
            self._sizes[tenant] -= len(node.key)
            evicted += len(node.key)
            parent = node.parent
            self._prune(node)
            if (parent is not None and parent is not self.root and tenant in parent.tenants
                    and not any(tenant in c.tenants for c in parent.children.values())):
                heapq.heappush(heap, (parent.tenants[tenant], id(parent), parent))
        return evicted

    def _tenant_leaves(self, tenant: str) -> Iterable[_Node]:
        stack = [c for c in self.root.children.values() if tenant in c.tenants]
        while stack:
            node = stack.pop()
            below = [c for c in node.children.values() if tenant in c.tenants]
            if below:
                stack.extend(below)
            else:
                yield node

    # --- checks ----------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Assert the invariants: tenants nest, sizes add up, no empty nodes, children keyed right."""
        sizes: dict[str, int] = {}
        stack = [self.root]
        while stack:
            node = stack.pop()
            for first, child in node.children.items():
                assert child.parent is node, "broken parent link"
                assert len(child.key) > 0 and child.key[0] == first, "child keyed by the wrong element"
                assert child.tenants, "a node no tenant lists was kept"
                if node is not self.root:
                    assert set(child.tenants) <= set(node.tenants), "a tenant on a child is missing on its parent"
                for t in child.tenants:
                    sizes[t] = sizes.get(t, 0) + len(child.key)
                stack.append(child)
        for t, n in self._sizes.items():
            assert sizes.get(t, 0) == n, f"size of {t}: counted {sizes.get(t, 0)}, recorded {n}"
