"""``KVTier`` and its stores alone: blocks round-trip byte for byte, the cap evicts the least recently
used, a restart finds the file store's blocks, and every kind of bad block (truncated, another
model's, other tokens, a write cut short) is refused, never returned."""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from radixserve.mem.kv_tier import KVTier, chain_keys, chain_root
from radixserve.mem.tier_store import FileStore, MemoryStore, TierStore

MODEL = b"m" * 16
B = 4


def parts(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, 2, 3, generator=g).to(torch.bfloat16) for _ in range(4)]


def payload_of(ps: list[torch.Tensor]) -> bytes:
    return b"".join(p.contiguous().view(torch.uint8).numpy().tobytes() for p in ps)


def chain(ids: list[int], extra: str | None = None) -> tuple[bytes, list[bytes]]:
    root = chain_root(MODEL, extra)
    return root, chain_keys(root, ids, B, len(ids) // B)


def store_chain(tier: KVTier, ids: list[int], seed: int = 0) -> list[bytes]:
    root, keys = chain(ids)
    for b, k in enumerate(keys):
        tier.put(k, keys[b - 1] if b else root, ids[b * B : (b + 1) * B], parts(seed + b))
    return keys


def fetch_all(tier: KVTier, ids: list[int]) -> Any:
    root, keys = chain(ids)
    return tier.fetch(keys, [keys[b - 1] if b else root for b in range(len(keys))],
                      [ids[b * B : (b + 1) * B] for b in range(len(keys))]).result(10)


def make(store: TierStore, cap: int = 1 << 20) -> KVTier:
    return KVTier(store, model_id=MODEL, block_tokens=B, capacity_bytes=cap)


def test_chain_keys_name_content_from_the_start() -> None:
    _, a = chain([1, 2, 3, 4, 5, 6, 7, 8])
    _, b = chain([1, 2, 3, 4, 5, 6, 7, 9, 0, 0, 0, 0])
    _, c = chain([1, 2, 3, 4, 5, 6, 7, 8], extra="lora-1")
    assert a[0] == b[0] and a[1] != b[1]  # same first block, different second
    assert not set(a) & set(c)  # another namespace shares nothing
    other = chain_keys(chain_root(b"x" * 16, None), [1, 2, 3, 4], B, 1)
    assert other[0] != a[0]  # another model shares nothing


@pytest.mark.parametrize("kind", ["file", "memory"])
def test_blocks_round_trip(kind: str, tmp_path: Any) -> None:
    tier = make(FileStore(str(tmp_path)) if kind == "file" else MemoryStore())
    ids = list(range(10, 22))
    store_chain(tier, ids)
    got = fetch_all(tier, ids)  # (read back from memory while the writes are queued, or from the store)
    assert [bytes(p) for p in got.payloads] == [payload_of(parts(b)) for b in range(3)] and not got.bad
    tier.flush_writes()
    assert tier.stats.blocks_written == 3 and tier.stats.write_errors == 0
    got = fetch_all(tier, ids)
    assert [bytes(p) for p in got.payloads] == [payload_of(parts(b)) for b in range(3)] and not got.bad
    tier.check_integrity()
    tier.close()


def test_cap_drops_the_least_recently_used(tmp_path: Any) -> None:
    probe = make(MemoryStore())
    store_chain(probe, [1, 2, 3, 4])
    size = probe.used_bytes
    tier = make(FileStore(str(tmp_path)), cap=3 * size + 64)  # (headers differ by a few bytes)
    a = store_chain(tier, list(range(100, 108)), seed=1)  # 2 blocks
    b = store_chain(tier, list(range(200, 204)), seed=2)  # 1: full now
    fetch_all(tier, list(range(100, 108)))  # a is used again: b is the least recent
    c = store_chain(tier, list(range(300, 304)), seed=3)
    assert len(tier) == 3 and tier.used_bytes <= 3 * size + 64
    assert a[0] in tier and a[1] in tier and c[0] in tier and b[0] not in tier
    assert tier.stats.evicted_blocks == 1
    tier.flush_writes()
    names = {n for _, _, fs in os.walk(tmp_path) for n in fs}
    assert names == {k.hex() + ".kv" for k in (a[0], a[1], c[0])}  # the dropped block's file is gone
    tier.check_integrity()
    tier.close()


def test_a_restart_finds_the_blocks_and_removes_unfinished_writes(tmp_path: Any) -> None:
    tier = make(FileStore(str(tmp_path)))
    ids = list(range(30, 42))
    keys = store_chain(tier, ids)
    tier.close()
    # a write cut short by a kill leaves only a temporary file
    leftover = tmp_path / keys[0].hex()[:2] / (keys[0].hex() + ".kv.tmp.12345")
    leftover.write_bytes(b"RSKVBLK1 half a block")
    again = make(FileStore(str(tmp_path)))
    assert len(again) == 3 and not leftover.exists()
    got = fetch_all(again, ids)
    assert [bytes(p) for p in got.payloads] == [payload_of(parts(b)) for b in range(3)]
    again.close()


@pytest.mark.parametrize("damage", ["truncate", "flip", "other-model", "garbage"])
def test_a_bad_block_stops_the_load_and_is_named(damage: str, tmp_path: Any) -> None:
    tier = make(FileStore(str(tmp_path)))
    ids = list(range(50, 62))
    keys = store_chain(tier, ids)
    tier.close()
    path = tmp_path / keys[1].hex()[:2] / (keys[1].hex() + ".kv")
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) - 10])
    elif damage == "flip":
        path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    elif damage == "garbage":
        path.write_bytes(os.urandom(len(data)))
    else:  # a block written by another model under the same name
        other = KVTier(FileStore(str(tmp_path / "x")), model_id=b"o" * 16, block_tokens=B, capacity_bytes=1 << 20)
        root = chain_root(MODEL, None)
        other.put(keys[1], keys[0], ids[4:8], parts(1))
        other.close()
        src = tmp_path / "x" / keys[1].hex()[:2] / (keys[1].hex() + ".kv")
        path.write_bytes(src.read_bytes())
        assert root  # (the parent is right: only the model differs)
    again = make(FileStore(str(tmp_path)))
    got = fetch_all(again, ids)
    assert len(got.payloads) == 1 and [k for k, _ in got.bad] == [keys[1]]  # nothing past the bad block
    again.forget(keys[1])
    assert keys[1] not in again
    again.close()


class FullDisk(MemoryStore):
    """A store whose writes fail as on a full disk."""

    def put(self, key: str, parts: Sequence[Any]) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_failed_write_drops_the_block_and_counts(caplog: Any) -> None:
    tier = make(FullDisk())
    ids = list(range(70, 78))
    store_chain(tier, ids)
    tier.flush_writes()
    assert tier.stats.write_errors == 2 and len(tier) == 0 and tier.used_bytes == 0
    assert "No space left on device" in caplog.text
    tier.check_integrity()
    tier.close()


def test_an_unwritable_directory_is_refused_at_once(tmp_path: Any) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(OSError):
        FileStore(str(blocker / "tier"))
