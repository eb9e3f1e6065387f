"""The KV tier on the real model, in process: a prompt evicted from a small pool comes back from the
tier with the same output as a pool hit, a new engine over the same directory finds it, damaged
blocks are computed again, and a tier directory that cannot be used leaves the engine serving."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from radixserve.engine import Engine
from radixserve.model.model_runner import ModelRunner

GREEDY = {"max_new_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner(None)


def text(i: int) -> str:
    topics = ["rivers", "mountains", "deserts", "forests", "oceans", "glaciers"]
    return " ".join(f"Note {j} on {topics[i]}: the {topics[(i + j) % 6]} of region {j * 7 + i} are described." for j in range(20))


def engine(runner: ModelRunner, tier_dir: Path | str, **kw: Any) -> Engine:
    return Engine(runner=runner, max_total_tokens=1024, enable_hierarchical_cache=True,
                  hicache_storage_dir=str(tier_dir), hicache_ratio=16.0, **kw)


def evict_with_others(e: Engine) -> None:
    for i in range(1, 5):
        e.generate(text(i), GREEDY)


def test_an_evicted_prompt_comes_back_from_the_tier(runner: ModelRunner, tmp_path: Path) -> None:
    e = engine(runner, tmp_path)
    e.generate(text(0), GREEDY)
    hit = e.generate(text(0), GREEDY)  # from the pool
    n = hit["meta_info"]["prompt_tokens"]
    assert hit["meta_info"]["cached_tokens"] == n - 1 and n > 300
    evict_with_others(e)
    assert e.scheduler.kv.tree_cache.peek_prefix_len(_key(e, 0)) < n // 2  # mostly evicted from the pool
    back = e.generate(text(0), GREEDY)
    tier = e.scheduler.kv.tier
    assert tier is not None and tier.snapshot()["hit_tokens"] >= n // 2
    assert back["meta_info"]["cached_tokens"] >= n - 64
    assert back["output_ids"] == hit["output_ids"]  # the same KV as the pool hit read
    e.check_memory_invariant()
    e.shutdown()
    # a new engine (a restarted server) over the same directory
    again = engine(runner, tmp_path)
    first = again.generate(text(0), GREEDY)
    assert first["meta_info"]["cached_tokens"] >= n - 64 and first["output_ids"] == hit["output_ids"]
    again.check_memory_invariant()
    again.shutdown()


def _key(e: Engine, i: int) -> Any:
    from radixserve.mem.base_cache import RadixKey

    return RadixKey(e.tokenizer.encode(text(i)))


def test_damaged_blocks_are_computed_again(runner: ModelRunner, tmp_path: Path) -> None:
    e = engine(runner, tmp_path)
    want = e.generate(text(0), GREEDY)
    e.shutdown()
    files = sorted(tmp_path.rglob("*.kv"))
    assert files
    for f in files:
        data = f.read_bytes()
        f.write_bytes(data[: len(data) - 100])  # every block truncated
    again = engine(runner, tmp_path)
    got = again.generate(text(0), GREEDY)
    tier = again.scheduler.kv.tier
    assert tier is not None and tier.snapshot()["corrupt_blocks"] >= 1 and tier.snapshot()["hit_tokens"] == 0
    assert got["meta_info"]["cached_tokens"] == 0 and got["output_ids"] == want["output_ids"]  # computed, as cold
    again.check_memory_invariant()
    again.shutdown()


def test_an_unusable_tier_directory_leaves_the_engine_serving(runner: ModelRunner, tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    e = engine(runner, blocker / "tier")
    assert e.scheduler.kv.tier is None and "running without the tier" in caplog.text
    out = e.generate(text(0), GREEDY)
    assert out["meta_info"]["completion_tokens"] == 6
    e.check_memory_invariant()
    e.shutdown()
