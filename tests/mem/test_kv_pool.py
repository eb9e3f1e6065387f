"""KVPool's buffers: zeros of the asked shape, untouched (so not resident) until KV is written, and
backed by transparent huge pages where Linux offers them (the decode kernel reads scattered pages
of buffers tens of MB large)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from radixserve.mem.kv_pool import KVPool, advise_huge_pages


def _thp_mode() -> str | None:
    """The bracketed word of /sys/kernel/mm/transparent_hugepage/enabled, or None off Linux."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    m = re.search(r"\[(\w+)\]", text)
    return m.group(1) if m else None


def _smaps_kib(t: torch.Tensor, field: str = "AnonHugePages:") -> int:
    """``field`` (AnonHugePages, Rss...) summed over the mappings that overlap ``t``'s memory
    (/proc/self/smaps; advising part of a mapping splits it in the kernel's books)."""
    start, end = t.data_ptr(), t.data_ptr() + t.nbytes
    inside, total = False, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if re.fullmatch(r"[0-9a-f]+-[0-9a-f]+", head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < end and start < hi
        elif inside and head == field:
            total += int(line.split()[1])
    return total


def test_buffers_are_zeroed_and_shaped() -> None:
    kv = KVPool(100, 4, 2, 3, 8, torch.bfloat16)
    assert len(kv.k_buffers) == len(kv.v_buffers) == 2
    for buf in kv.k_buffers + kv.v_buffers:
        assert buf.shape == (104, 3, 8) and buf.dtype == torch.bfloat16 and buf.is_contiguous()
        assert not buf.any()


def _rss_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="no /proc/self/statm here")
def test_the_pool_costs_no_memory_until_kv_is_written() -> None:
    """A pool of 2 x 64 MiB is usable at once: its pages are the kernel's zero-fill-on-touch
    (zeroing them at start took seconds on a server-sized pool), and writing a quarter of one
    buffer makes about that quarter resident."""
    before = _rss_mib()
    kv = KVPool((64 << 20) // (3 * 64 * 2), 16, 1, 3, 64, torch.bfloat16)
    assert _rss_mib() - before < 8
    k = kv.k_buffers[0]
    k[: k.shape[0] // 4].fill_(1.0)
    assert 14 <= _rss_mib() - before <= 28  # 16 MiB, give or take huge pages at the edges
    assert not k[k.shape[0] // 4 :].any() and not kv.v_buffers[0].any()  # the rest reads as zeros


def test_small_tensors_are_left_alone() -> None:
    assert advise_huge_pages(torch.empty(1000)) is False  # holds no whole 2 MiB page


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="transparent huge pages are off here")
def test_large_buffers_get_huge_pages() -> None:
    """A pool of 64 MiB per buffer: its buffers hold at least half of it in huge pages (the kernel
    may fall back to small pages where it finds no free 2 MiB block, so not necessarily all), even
    right after 320 MiB of touched memory went back to malloc's heap, as after a model load (a
    torch.empty buffer reuses it, 4 KiB pages and all: 0 KiB of huge pages, measured)."""
    from radixserve.model.model_runner import tune_malloc

    tune_malloc()  # what every ModelRunner sets: freed memory stays in the heap
    freed = [torch.ones(16 << 20, dtype=torch.uint8) for _ in range(20)]
    del freed
    kv = KVPool((64 << 20) // (3 * 64 * 2), 16, 1, 3, 64, torch.bfloat16)
    for b in kv.k_buffers + kv.v_buffers:
        b[::1000].fill_(1.0)  # the first K/V writes: one row in every 384 KB
    gained = sum(_smaps_kib(b) for b in kv.k_buffers + kv.v_buffers)
    assert gained >= (2 * 64 << 10) // 2, gained
    del kv
