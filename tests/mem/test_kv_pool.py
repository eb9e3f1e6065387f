"""KVPool's buffers: zeroed, of the asked shape, and backed by transparent huge pages where Linux
offers them (the decode kernel reads scattered pages of buffers tens of MB large)."""

from __future__ import annotations

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


def _anon_huge_kib() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def test_buffers_are_zeroed_and_shaped() -> None:
    kv = KVPool(100, 4, 2, 3, 8, torch.bfloat16)
    assert len(kv.k_buffers) == len(kv.v_buffers) == 2
    for buf in kv.k_buffers + kv.v_buffers:
        assert buf.shape == (104, 3, 8) and buf.dtype == torch.bfloat16 and buf.is_contiguous()
        assert not buf.any()


def test_small_tensors_are_left_alone() -> None:
    assert advise_huge_pages(torch.empty(1000)) is False  # holds no whole 2 MiB page


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="transparent huge pages are off here")
def test_large_buffers_get_huge_pages() -> None:
    """A pool of 64 MiB per buffer: the process gains at least half of it in huge pages (the kernel
    may fall back to small pages where it finds no free 2 MiB block, so not necessarily all)."""
    before = _anon_huge_kib()
    kv = KVPool((64 << 20) // (3 * 64 * 2), 16, 1, 3, 64, torch.bfloat16)
    gained = _anon_huge_kib() - before
    assert gained >= (2 * 64 << 10) // 2, gained
    del kv
