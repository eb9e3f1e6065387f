"""The real KV tensors and the request -> token-slot table.

``KVPool`` holds, per layer, a K and a V buffer of shape ``[num_slots, num_kv_heads, head_dim]``.
Slot ids come from ``TokenToKVPoolAllocator``; the first page (slots ``0 .. page_size-1``) is
reserved as a padding target and is never handed out, so a padded gather never touches live KV.

``ReqToTokenPool`` maps a request slot (one row per running request) to the KV slot of each of its
tokens: ``req_to_token[req_pool_idx, pos]`` is where token ``pos`` of that request lives. For a
model with sliding-window layers among global ones it keeps a twin table of the sliding layers' own
slots (``window``, written through ``window_kv``: mem/window_kv.py) with each write.

The K/V buffers ask Linux for transparent huge pages (2 MiB) before they are first touched. A decode
step reads each running request's pages, scattered over buffers of tens of MB per layer (GBs in
all), so with 4 KiB pages nearly every page of KV costs TLB misses and page-table walks from memory.
Measured with the decode kernel on a pool of 160k slots, its calls alternated between the two
kinds of buffers: 1.03-1.10x faster with huge pages (docs/benchmarks.md).

The buffers are not written at start: fresh anonymous memory reads as zeros, and the kernel backs
each page the first time a K/V write touches it. A server is usable as soon as the pool is mapped
(zeroing a 3.5 GiB pool took seconds, more with huge pages while the kernel compacted memory), and
a pool larger than the traffic never costs memory it does not use.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from radixserve.mem.forward_batch import int64_tensor
from radixserve.mem.kv_format import KVFormat, raw
from radixserve.mem.window_kv import WindowKV

_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask Linux to back ``t``'s memory (the whole 2 MiB pages inside it) with transparent huge pages
    from their first touch on. True if the kernel accepted; a no-op elsewhere, for small tensors, or
    where THP is off (``madvise`` succeeds, nothing changes)."""
    if t.device.type != "cpu" or not sys.platform.startswith("linux"):
        return False
    start = (t.data_ptr() + _HUGE_PAGE - 1) & ~(_HUGE_PAGE - 1)
    end = (t.data_ptr() + t.nbytes) & ~(_HUGE_PAGE - 1)
    if end <= start:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE) == 0)
    except (OSError, AttributeError):
        return False


def resident_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s memory that physical pages back now (Linux ``mincore``; 0 elsewhere): of a
    KV buffer, what its writes have touched."""
    if t.device.type != "cpu" or not sys.platform.startswith("linux") or t.nbytes == 0:
        return 0
    page = mmap.PAGESIZE
    start = t.data_ptr() & ~(page - 1)
    n = (t.data_ptr() + t.nbytes - start + page - 1) // page
    vec = (ctypes.c_ubyte * n)()
    try:
        libc = ctypes.CDLL("libc.so.6")
        if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(n * page), vec) != 0:
            return 0
    except (OSError, AttributeError):
        return 0
    return int((np.frombuffer(memoryview(vec), dtype=np.uint8) & 1).sum()) * page


def _zeros(rows: int, heads: int, dim: int, dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """A K or V buffer of zeros on memory fresh from the kernel, advised into huge pages before
    anything touches it. Not ``torch.empty``: malloc may hand back memory already touched (the
    float32 weights freed after quantizing the model, say), whose 4 KiB pages an advice no longer
    changes, and which is not zero."""
    if torch.device(device).type != "cpu":
        return torch.zeros(rows, heads, dim, dtype=dtype, device=device)
    nbytes = rows * heads * dim * torch.empty(0, dtype=dtype).element_size()
    # private anonymous memory: a shared mapping (mmap's default) is shmem, where THP has its own
    # setting (usually off); the tensor keeps the mapping alive
    mem = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf = torch.frombuffer(mem, dtype=torch.uint8).view(dtype).view(rows, heads, dim)
    advise_huge_pages(buf)
    return buf  # zeros already: the kernel zero-fills each page on its first touch


class KVPool:
    """Per layer, K and V buffers of ``[rows, num_kv_heads, head_dim]`` in the format's storage type
    (``kv_format.py``), and for a scaled format (int8, fp8_e4m3) their ``[rows, num_kv_heads]``
    float32 scales.
    Everything that writes or reads KV goes through ``write`` / ``read`` (attention), ``gather`` /
    ``scatter`` (what leaves the pool and comes back: a transfer, the KV tier) or, for the paged
    kernel, the buffers and scales themselves."""

    def __init__(
        self,
        size: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype | KVFormat,
        device: str | torch.device = "cpu",
    ) -> None:
        self.size = size
        self.page_size = page_size
        self.num_layers = num_layers
        self.format = dtype if isinstance(dtype, KVFormat) else KVFormat.plain(dtype)
        self.dtype = self.format.storage
        rows = size + page_size  # + the reserved padding page
        st = self.dtype
        self.k_buffers = [_zeros(rows, num_kv_heads, head_dim, st, device) for _ in range(num_layers)]
        self.v_buffers = [_zeros(rows, num_kv_heads, head_dim, st, device) for _ in range(num_layers)]
        self.k_scales: list[torch.Tensor] = []
        self.v_scales: list[torch.Tensor] = []
        if self.format.scaled:
            self.k_scales = [_zeros(rows, num_kv_heads, 1, torch.float32, device).view(rows, num_kv_heads)
                             for _ in range(num_layers)]
            self.v_scales = [_zeros(rows, num_kv_heads, 1, torch.float32, device).view(rows, num_kv_heads)
                             for _ in range(num_layers)]

    def write(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k, v: [T, kv_heads, head_dim]`` of layer ``layer`` at slots ``loc``."""
        for src, bufs, scales in ((k, self.k_buffers, self.k_scales), (v, self.v_buffers, self.v_scales)):
            data, sc = self.format.encode(src)
            raw(bufs[layer]).index_copy_(0, loc, raw(data))
            if sc is not None:
                scales[layer].index_copy_(0, loc, sc)

    def scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
        """Layer ``layer``'s K and V scales, or ``(None, None)`` in a format without them."""
        return (self.k_scales[layer], self.v_scales[layer]) if self.format.scaled else (None, None)

    def read(self, layer: int, idx: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of layer ``layer`` at slots ``idx`` (any shape of indices, flattened), as ``dtype``."""
        out = []
        for bufs, scales in ((self.k_buffers, self.k_scales), (self.v_buffers, self.v_scales)):
            buf = bufs[layer]
            data = raw(buf).index_select(0, idx).view(buf.dtype)
            out.append(self.format.decode(data, scales[layer].index_select(0, idx) if scales else None, dtype))
        return out[0], out[1]

    def _parts(self) -> list[torch.Tensor]:
        """The per-layer buffers in ``gather``'s order: ``K_l, V_l`` (and ``K scales_l, V scales_l``)."""
        out: list[torch.Tensor] = []
        for i in range(self.num_layers):
            out += (self.k_buffers[i], self.v_buffers[i])
            if self.format.scaled:
                out += (self.k_scales[i], self.v_scales[i])
        return out

    def part_row_bytes(self) -> list[int]:
        """Bytes one token takes in each of ``gather``'s parts."""
        return [p[0].numel() * p.element_size() for p in self._parts()]

    def gather(self, slots: Sequence[int]) -> list[torch.Tensor]:
        """The rows of ``slots`` for every layer (``K_0, V_0, .., K_{L-1}, V_{L-1}``, each layer's
        scales after its V in a scaled format), each a fresh contiguous ``[n, ...]`` tensor as
        stored: what leaves the pool (a transfer, the KV tier)."""
        idx = torch.tensor(list(slots), dtype=torch.int64)
        return [raw(p).index_select(0, idx) for p in self._parts()]

    def scatter(self, slots: Sequence[int], parts: Sequence[Any]) -> int:
        """Write ``parts`` (buffers in ``gather``'s order and layout, e.g. received frames or a tier
        block's payload cut per part) into ``slots``; returns the bytes written. Raises ``ValueError``
        on a count or size mismatch, before writing anything."""
        dsts = self._parts()
        if len(parts) != len(dsts):
            raise ValueError(f"{len(parts)} KV parts, expected {len(dsts)}")
        views = [memoryview(p).cast("B") for p in parts]
        for i, (mv, dst) in enumerate(zip(views, dsts, strict=True)):
            want = len(slots) * dst[0].numel() * dst.element_size()
            if len(mv) != want:
                raise ValueError(f"KV part {i} has {len(mv)} bytes for {len(slots)} tokens (expected {want})")
        if not slots:
            return 0
        idx = torch.tensor(list(slots), dtype=torch.int64)
        for mv, dst in zip(views, dsts, strict=True):
            d = raw(dst)
            d.index_copy_(0, idx, torch.frombuffer(mv, dtype=torch.uint8).view(d.dtype).view(len(slots), *d.shape[1:]))
        return sum(len(mv) for mv in views)

    def resident_bytes(self, layers: Sequence[int] | None = None) -> tuple[int, int]:
        """(bytes touched, bytes mapped) of the K/V buffers and scales of ``layers`` (all by default)."""
        touched = mapped = 0
        for i in range(self.num_layers) if layers is None else layers:
            for t in (self.k_buffers[i], self.v_buffers[i], *((self.k_scales[i], self.v_scales[i])
                                                              if self.format.scaled else ())):
                touched += resident_bytes(t)
                mapped += t.nbytes
        return touched, mapped

    def bytes_per_token_here(self) -> int:
        """KV bytes one token takes in this pool (every layer's K and V row, and their scales)."""
        return sum(self.part_row_bytes())

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype | KVFormat) -> int:
        fmt = dtype if isinstance(dtype, KVFormat) else KVFormat.plain(dtype)
        return 2 * num_layers * fmt.row_bytes(num_kv_heads, head_dim)


class ReqToTokenPool:
    def __init__(self, size: int, max_context_len: int, device: str | torch.device = "cpu") -> None:
        self.size = size
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros(size, max_context_len, dtype=torch.int64, device=device)
        self._free: list[int] = list(range(size - 1, -1, -1))  # pop() hands out 0 first
        self.window_kv: WindowKV | None = None
        self.window: ReqToTokenPool | None = None  # the twin table, in the sliding layers' slots

    def attach_window_kv(self, window_kv: WindowKV) -> None:
        """Keep the twin table of ``window_kv``'s slots from now on (before any request is admitted)."""
        self.window_kv = window_kv
        self.window = ReqToTokenPool(self.size, self.max_context_len, self.req_to_token.device)

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, idx: int) -> None:
        if idx in self._free:  # NOTE: O(size) but size is small; a double free is a bug to catch
            raise RuntimeError(f"request slot {idx} freed twice")
        self._free.append(idx)

    def write(self, idx: int, start: int, slots: Sequence[int]) -> None:
        if slots:
            t = int64_tensor(slots)
            self.req_to_token[idx, start : start + len(slots)] = t
            if self.window is not None and self.window_kv is not None:
                self.window.req_to_token[idx, start : start + len(slots)] = self.window_kv.translate(t)

    def write_many(self, rows: list[int], cols: list[int], slots: list[int]) -> None:
        """``req_to_token[rows[i], cols[i]] = slots[i]`` for every i, as one indexed assignment
        (a decode step's writes: one slot per running request)."""
        if slots:
            t = self.req_to_token
            dev = t.device
            v = int64_tensor(slots)
            r, c = int64_tensor(rows).to(dev), int64_tensor(cols).to(dev)
            t[r, c] = v.to(dev)
            if self.window is not None and self.window_kv is not None:  # (its page map is on the CPU)
                self.window.req_to_token[r, c] = self.window_kv.translate(v).to(dev)


class JournaledReqToTokenPool(ReqToTokenPool):
    """A ``ReqToTokenPool`` that also records every write since the last ``take_journal``.

    Under tensor parallelism rank 0's scheduler is the only writer of the table; the other ranks
    keep a copy that the attention reads, brought up to date each step by ``replay_journal`` of
    what rank 0 wrote since the previous step (a few ints per request, instead of the rows).

    Journal format, flat ints: ``row, start, n, slot*n`` for ``write`` and ``-1, n, row*n, col*n,
    slot*n`` for ``write_many``.
    """

    def __init__(self, size: int, max_context_len: int, device: str | torch.device = "cpu") -> None:
        super().__init__(size, max_context_len, device)
        self.journal: list[int] = []

    def write(self, idx: int, start: int, slots: Sequence[int]) -> None:
        super().write(idx, start, slots)
        if slots:
            self.journal += (idx, start, len(slots))
            self.journal += slots

    def write_many(self, rows: list[int], cols: list[int], slots: list[int]) -> None:
        super().write_many(rows, cols, slots)
        if slots:
            self.journal += (-1, len(slots))
            self.journal += rows
            self.journal += cols
            self.journal += slots

    def attach_window_kv(self, window_kv: WindowKV) -> None:
        raise ValueError("sliding-window layers' own slots are not journaled for tensor parallelism")

    def take_journal(self) -> list[int]:
        out, self.journal = self.journal, []
        return out


def replay_journal(pool: ReqToTokenPool, journal: torch.Tensor) -> None:
    """Apply a ``JournaledReqToTokenPool`` journal (an int64 tensor) to another pool's table."""
    t = pool.req_to_token
    vals = journal.to(t.device)
    ints = journal.tolist()  # the headers are read one by one: faster from a list
    i = 0
    while i < len(ints):
        if ints[i] >= 0:
            row, start, n = ints[i : i + 3]
            t[row, start : start + n] = vals[i + 3 : i + 3 + n]
            i += 3 + n
        else:
            n, b = ints[i + 1], i + 2
            t[vals[b : b + n], vals[b + n : b + 2 * n]] = vals[b + 2 * n : b + 3 * n]
            i = b + 3 * n
