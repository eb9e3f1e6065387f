"""``radixserve bench radix`` runs its trace through the real cache and allocator, checks that no
slot leaked, and writes figures for both allocators."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from radixserve.bench.radix import make_trace
from radixserve.cli import main


@pytest.mark.parametrize("page_size", [1, 16])
def test_the_trace_fills_the_pool_without_overflowing_it(page_size: int) -> None:
    trace = make_trace(40_000, 4, page_size, seed=1)
    assert all(len(r) % page_size == 0 for r in trace)
    assert len({tuple(r[:300]) for r in trace}) <= 4  # every request opens with one of the system prompts


def test_bench_radix_writes_both_allocators_figures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "radix.json"
    assert main(["bench", "radix", "--tokens", "30000", "--prefixes", "4", "--rounds", "1", "--page-size", "4",
                 "--output", str(out)]) == 0
    assert "evict_half" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    for name in ("allocator", "counting"):
        fig = doc[name]
        assert fig["evicted_tokens"] >= fig["cached_tokens"] // 2 > 10_000  # the pool was nearly full
        assert fig["insert_ms"] > 0 and fig["match_ms"] > 0 and fig["evict_half_ms"] > 0
