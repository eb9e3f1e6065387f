"""``KVTier``: the second tier behind the radix cache, blocks of KV kept in a ``TierStore`` under a
size cap, found again by their content.

Blocks are ``block_tokens`` tokens long and aligned from the start of a prefix; block ``b`` of a
prefix is named by ``chain_keys``: BLAKE2b over the previous block's name and the block's token ids,
the chain starting from the model's identity and the cache namespace. Equal names mean equal tokens
from the start, computed by the same model, so a name is all a lookup needs, across restarts too.

The index (name -> bytes stored) is in LRU order: a store or a load moves a block to the end, and
the cap (``capacity_bytes``) drops blocks from the front. A chain is touched from its last block to
its first (``touch``), so within a chain the later blocks go first: a chain whose first block went
could not be loaded at all. Only the scheduler's thread touches it.
Writes go to one writer thread, in order (a delete queued after a write runs after it); until a
write lands, the block's bytes stay in memory and a load takes them from there. Loads run on a
reader thread (``fetch``), which checks each stored block (``tier_store.decode_block``) and stops
at the first that is missing or fails: a load returns the payloads of consecutive good blocks and
the names of bad ones, which the caller drops (``forget``). A write that fails (a full disk, say)
drops its block and is logged; nothing stops serving.

``inline=True`` runs writes and reads in the caller's thread instead (the simulator: a run must not
depend on thread timing), and ``block_bytes`` makes every block count that many bytes against the
cap whatever it stores (the simulator's blocks stand for a GPU model's KV without holding it).
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import zlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from radixserve.mem.tier_store import BlockHeader, CorruptBlock, TierStore, decode_block, encode_block

logger = logging.getLogger(__name__)

KEY_BYTES = 16


def chain_root(model_id: bytes, extra_key: str | None) -> bytes:
    """The name a chain's first block continues: the model and the cache namespace."""
    return hashlib.blake2b(model_id + b"\0" + (extra_key or "").encode(), digest_size=KEY_BYTES).digest()


def chain_keys(root: bytes, ids: Sequence[int], block_tokens: int, n_blocks: int) -> list[bytes]:
    """The names of the first ``n_blocks`` blocks of ``ids``."""
    keys: list[bytes] = []
    h = root
    for b in range(n_blocks):
        h = hashlib.blake2b(h + array("i", ids[b * block_tokens : (b + 1) * block_tokens]).tobytes(),
                            digest_size=KEY_BYTES).digest()
        keys.append(h)
    return keys


def split_payloads(payloads: Sequence[memoryview], block_tokens: int, row_bytes: Sequence[int],
                   skip: int) -> list[bytearray]:
    """Blocks' payloads as ``KVPool.scatter``'s parts, without the first ``skip`` rows. A block's
    payload is its parts one after the other (``KVPool.gather``'s order), ``block_tokens`` rows
    each, ``row_bytes[j]`` bytes a row in part ``j``."""
    B = block_tokens
    block = B * sum(row_bytes)
    for mv in payloads:
        if len(mv) != block:
            raise ValueError(f"a tier block has {len(mv)} payload bytes, the pool's blocks {block}")
    rows = len(payloads) * B - skip
    out: list[bytearray] = []
    start = 0  # where part j starts in a block's payload
    for row in row_bytes:
        part = bytearray(rows * row)
        at = 0
        for i, mv in enumerate(payloads):
            piece = mv[start + (skip if i == 0 else 0) * row : start + B * row]
            part[at : at + len(piece)] = piece
            at += len(piece)
        out.append(part)
        start += B * row
    return out


@dataclass
class TierStats:
    blocks_written: int = 0
    bytes_written: int = 0
    write_errors: int = 0
    blocks_loaded: int = 0
    bytes_loaded: int = 0
    corrupt_blocks: int = 0
    evicted_blocks: int = 0


@dataclass
class Fetched:
    """What a load found: the payloads of consecutive good blocks, then the bad blocks' names and why."""

    payloads: list[memoryview]
    bad: list[tuple[bytes, str]]


class KVTier:
    def __init__(self, store: TierStore, *, model_id: bytes, block_tokens: int, capacity_bytes: int,
                 inline: bool = False, block_bytes: int | None = None) -> None:
        self.on_drop: Callable[[bytes], None] | None = None  # told of each block that leaves the index
        self.store = store
        self.model_id = model_id
        self.block_tokens = block_tokens
        self.capacity_bytes = capacity_bytes
        self.stats = TierStats()
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self._pending: dict[bytes, tuple[int, memoryview]] = {}  # written soon: (job id, payload)
        self.used_bytes = 0
        self._jobs: queue.Queue[tuple[str, bytes, int, list[Any]] | None] = queue.Queue()
        self._done: deque[tuple[bytes, int, str | None]] = deque()  # (key, job id, error) from the writer
        self._job_id = 0
        self._errors_logged = 0
        self._block_bytes = block_bytes
        self.found_at_start: list[bytes] = []  # blocks a persistent store held when the tier opened
        self._scan()
        self._writer: threading.Thread | None = None
        self._reader: ThreadPoolExecutor | None = None
        if not inline:
            self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True)
            self._writer.start()
            self._reader = ThreadPoolExecutor(1, thread_name_prefix="kv-tier-reader")

    def _scan(self) -> None:
        found = 0
        try:
            for name, size in self.store.scan():
                try:
                    key = bytes.fromhex(name)
                except ValueError:
                    continue
                if len(key) == KEY_BYTES:
                    self._index[key] = size
                    self.used_bytes += size
                    self.found_at_start.append(key)
                    found += 1
        except OSError as e:
            logger.warning("KV tier: could not list the stored blocks (%s); starting empty", e)
        if found:
            logger.info("KV tier: found %d stored blocks (%.1f MiB)", found, self.used_bytes / 2**20)
        self._make_room(0)

    def found_blocks(self) -> dict[bytes, tuple[bytes, list[int]]]:
        """The blocks found at start that are still held, with the parent and tokens their headers
        name (a block whose header cannot be read, or another model's, is left out: a load drops it)."""
        out: dict[bytes, tuple[bytes, list[int]]] = {}
        for key in self.found_at_start:
            if key not in self._index:
                continue
            try:
                h = self.store.header(key.hex())
            except (CorruptBlock, OSError):
                continue
            if h is not None and h.model == self.model_id and len(h.tokens) == self.block_tokens:
                out[key] = (h.parent, h.tokens)
        return out

    # --- lookups (the scheduler's thread) -----------------------------------------------------
    def __contains__(self, key: bytes) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def present_run(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, are stored."""
        n = 0
        for k in keys:
            if k not in self._index:
                break
            n += 1
        return n

    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark the blocks of a chain used now, the first one last (the most recent)."""
        index = self._index
        for k in reversed(keys):
            if k in index:
                index.move_to_end(k)

    # --- writes -------------------------------------------------------------------------------
    def put(self, key: bytes, parent: bytes, tokens: Sequence[int], parts: Sequence[torch.Tensor]) -> bool:
        """Store a block (its KV as ``KVPool.gather``'s parts); False if it does not fit the cap."""
        if key in self._index:
            self._index.move_to_end(key)
            return True
        payload = torch.cat([p.reshape(-1).view(torch.uint8) for p in parts]).numpy().data
        header = encode_block(BlockHeader(self.model_id, parent, list(tokens), len(payload), zlib.crc32(payload)))
        size = self._block_bytes or len(header) + len(payload)
        if size > self.capacity_bytes:
            return False
        self._make_room(size)
        self._job_id += 1
        self._index[key] = size
        self.used_bytes += size
        self._pending[key] = (self._job_id, payload)
        self._queue(("put", key, self._job_id, [header, payload]))
        return True

    def _make_room(self, size: int) -> None:
        while self._index and self.used_bytes + size > self.capacity_bytes:
            key, n = self._index.popitem(last=False)
            self._drop(key, n)
            self.stats.evicted_blocks += 1

    def _drop(self, key: bytes, size: int) -> None:
        self.used_bytes -= size
        self._pending.pop(key, None)
        self._queue(("delete", key, 0, []))
        if self.on_drop is not None:
            self.on_drop(key)

    def forget(self, key: bytes) -> None:
        """Drop a block (it failed its checks)."""
        size = self._index.pop(key, None)
        if size is not None:
            self._drop(key, size)

    def clear(self) -> None:
        """Drop every block."""
        for key in list(self._index):
            self.forget(key)

    def _queue(self, job: tuple[str, bytes, int, list[Any]]) -> None:
        if self._writer is None:
            self._run(job)
        else:
            self._jobs.put(job)

    def _write_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self._run(job)

    def _run(self, job: tuple[str, bytes, int, list[Any]]) -> None:
        op, key, job_id, parts = job
        if op == "mark":
            parts[0].set()
            return
        err: str | None = None
        try:
            if op == "put":
                self.store.put(key.hex(), parts)
            else:
                self.store.delete(key.hex())
        except OSError as e:
            err = f"{type(e).__name__}: {e}"
        if op == "put":
            self._done.append((key, job_id, err))

    def poll(self) -> None:
        """Take in the writer's results: a landed block leaves memory, a failed one the index."""
        done = self._done
        while done:
            key, job_id, err = done.popleft()
            pend = self._pending.get(key)
            if pend is None or pend[0] != job_id:
                continue  # dropped (or stored again) meanwhile
            del self._pending[key]
            if err is None:
                self.stats.blocks_written += 1
                self.stats.bytes_written += self._index.get(key, 0)
                continue
            self.stats.write_errors += 1
            size = self._index.pop(key, None)
            if size is not None:
                self.used_bytes -= size
                if self.on_drop is not None:
                    self.on_drop(key)
            if self._errors_logged < 5 or self.stats.write_errors % 1000 == 0:
                self._errors_logged += 1
                logger.warning("KV tier: a block write failed (%s); its KV will be recomputed when needed "
                               "(%d failed writes so far)", err, self.stats.write_errors)

    def flush_writes(self, timeout: float = 30.0) -> None:
        """Wait until every queued write and delete has run (tests, shutdown)."""
        if self._writer is not None:
            ev = threading.Event()
            self._jobs.put(("mark", b"", 0, [ev]))
            ev.wait(timeout)
        self.poll()

    # --- loads --------------------------------------------------------------------------------
    def fetch(self, keys: Sequence[bytes], parents: Sequence[bytes], tokens: Sequence[Sequence[int]]) -> Future[Fetched]:
        """Read and check the blocks ``keys`` (the continuation of ``parents[i]`` with ``tokens[i]``)
        on the reader thread; the future's payloads stop at the first missing or bad block."""
        self.touch(keys)
        mem = [self._pending.get(k) for k in keys]
        args = (list(keys), list(parents), [list(t) for t in tokens], [m[1] if m is not None else None for m in mem])
        if self._reader is None:
            done: Future[Fetched] = Future()
            done.set_result(self._read(*args))
            return done
        return self._reader.submit(self._read, *args)

    def _read(self, keys: list[bytes], parents: list[bytes], tokens: list[list[int]],
              mem: list[memoryview | None]) -> Fetched:
        out = Fetched([], [])
        for key, parent, toks, held in zip(keys, parents, tokens, mem, strict=True):
            if held is not None:
                out.payloads.append(held)
                continue
            try:
                data = self.store.get(key.hex())
                if data is None:
                    break  # dropped meanwhile
                out.payloads.append(decode_block(data, model=self.model_id, parent=parent, tokens=toks))
            except (CorruptBlock, OSError) as e:
                out.bad.append((key, f"{type(e).__name__}: {e}"))
                break
        return out

    # --- checks and shutdown ----------------------------------------------------------------
    def check_integrity(self) -> None:
        total = sum(self._index.values())
        if total != self.used_bytes:
            raise AssertionError(f"KV tier: blocks add up to {total} bytes, the tier counts {self.used_bytes}")
        if self.used_bytes > self.capacity_bytes:
            raise AssertionError(f"KV tier holds {self.used_bytes} bytes over its cap {self.capacity_bytes}")
        stray = [k for k in self._pending if k not in self._index]
        if stray:
            raise AssertionError(f"KV tier: {len(stray)} pending writes of blocks not in the index")

    def close(self) -> None:
        if self._writer is not None and self._reader is not None:
            self._jobs.put(None)
            self._writer.join(30.0)
            self._reader.shutdown(wait=True)
