"""``TierEvents``: the KV tier's blocks as cache events (``mem.cache_events``, ``medium`` set), so
a router following a worker's cache also sees what the worker can load instead of compute.

Events name paths from the root, and a router credits a worker with a path whole; the tier can
only load a run of blocks that starts at the first. So a block is reported only once every block
before it is stored too: under ``write_back`` a child's blocks usually reach the tier before its
parent's, and are reported when the parent's complete their chain. This keeps, per block written
here, its parent's name, its tokens and its children (``_Entry``), to spell paths and to find
what a completed chain makes reportable. A dropped block is reported removed (the router drops
the worker from that path and everything below it, so its reported descendants become unreported)
and stays as a ghost while it has children. Blocks found on disk at start are reported once, when
the first request arrives, the chains among them that begin at the root (``found``: parents and
tokens from their headers). Only the default namespace is reported.
"""

from __future__ import annotations

from collections.abc import Callable

from radixserve.mem.cache_events import BlockRemoved, BlockStored, CacheEvent


class _Entry:
    __slots__ = ("parent", "tokens", "kids", "stored", "reported")

    def __init__(self, parent: bytes, tokens: list[int]) -> None:
        self.parent = parent
        self.tokens = tokens
        self.kids: list[bytes] = []
        self.stored = True
        self.reported = False


class TierEvents:
    def __init__(self, sink: Callable[[CacheEvent], None], medium: str) -> None:
        self.sink = sink
        self.medium = medium
        self.muted = False  # a flush: the tree's AllCleared says it all
        self._blocks: dict[bytes, _Entry] = {}
        self._roots: set[bytes] = set()  # chain roots (model and namespace) seen

    def stored(self, path: list[int], keys: list[bytes], root: bytes, present: Callable[[bytes], bool]) -> None:
        """Blocks of ``path`` (named ``keys``, from block 0) are in the tier now (``present`` says
        which blocks the tier holds)."""
        if self.muted or not keys:
            return
        B = len(path) // len(keys)
        self._roots.add(root)
        for b, key in enumerate(keys):
            e = self._blocks.get(key)
            if e is None:
                parent = keys[b - 1] if b else root
                e = self._blocks[key] = _Entry(parent, path[b * B : (b + 1) * B])
                up = self._blocks.get(parent)
                if up is not None:
                    up.kids.append(key)
            e.stored = present(key)
        complete = 0
        while complete < len(keys) and self._blocks[keys[complete]].stored:
            complete += 1
        first = next((b for b in range(complete) if not self._blocks[keys[b]].reported), complete)
        if first < complete:
            for key in keys[first:complete]:
                self._blocks[key].reported = True
            self.sink(BlockStored(path[: complete * B], first * B, self.medium))
        if complete:
            self._report_below(keys[complete - 1], path[: complete * B])

    def found(self, blocks: dict[bytes, tuple[bytes, list[int]]], root: bytes) -> None:
        """Blocks a persistent tier held when it opened (``KVTier.found_blocks``): each chain of them
        from ``root`` is reported, as if just stored."""
        self._roots.add(root)
        for key, (parent, tokens) in blocks.items():
            self._blocks.setdefault(key, _Entry(parent, tokens))
        for key, (parent, _) in blocks.items():
            up = self._blocks.get(parent)
            if up is not None and key not in up.kids:
                up.kids.append(key)
        for key, (parent, tokens) in blocks.items():
            e = self._blocks[key]
            if parent == root and not e.reported and not self.muted:
                e.reported = True
                self.sink(BlockStored(list(tokens), 0, self.medium))
                self._report_below(key, list(tokens))

    def _report_below(self, key: bytes, path: list[int]) -> None:
        """Report the stored, unreported blocks hanging from reported block ``key`` (whose path is ``path``)."""
        stack = [(key, path)]
        while stack:
            k, p = stack.pop()
            for kid in self._blocks[k].kids:
                e = self._blocks[kid]
                if e.stored:
                    q = p + e.tokens
                    if not e.reported:
                        e.reported = True
                        self.sink(BlockStored(q, len(p), self.medium))
                    stack.append((kid, q))

    def dropped(self, key: bytes) -> None:
        """A block left the tier."""
        e = self._blocks.get(key)
        if e is None:
            return
        e.stored = False
        if e.reported:
            path = self._path(key)
            if path is not None and not self.muted:
                self.sink(BlockRemoved(path, len(path) - len(e.tokens), self.medium))
            stack = [key]  # the router forgot everything below it too
            while stack:
                d = self._blocks[stack.pop()]
                d.reported = False
                stack.extend(d.kids)
        while e is not None and not e.stored and not e.kids:  # ghosts nothing runs through any more
            del self._blocks[key]
            parent = self._blocks.get(e.parent)
            if parent is not None:
                parent.kids.remove(key)
            key, e = e.parent, parent

    def _path(self, key: bytes) -> list[int] | None:
        """The tokens from the root to the end of block ``key``; None if a block before it was
        never written here (found on disk at start)."""
        parts: list[list[int]] = []
        e = self._blocks.get(key)
        while e is not None:
            parts.append(e.tokens)
            key = e.parent
            e = self._blocks.get(key)
        if key not in self._roots:
            return None
        return [t for part in reversed(parts) for t in part]

    def clear(self) -> None:
        self._blocks.clear()
