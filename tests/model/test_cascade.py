"""Shared-prefix decode attention equals plain attention over each request's whole sequence."""

from __future__ import annotations

import pytest
import torch

from radixserve.mem.forward_batch import ForwardBatch, SamplingBatchInfo
from radixserve.mem.kv_format import kv_format
from radixserve.mem.kv_pool import KVPool
from radixserve.model.attention import TorchNativeAttention
from radixserve.model.cascade import find_shared_prefixes


def _table(rows: list[list[int]], width: int = 64) -> torch.Tensor:
    t = torch.zeros(len(rows), width, dtype=torch.int64)
    for i, r in enumerate(rows):
        t[i, : len(r)] = torch.tensor(r)
    return t


def test_groups_found_at_the_deepest_useful_level() -> None:
    head = [1, 2, 3]  # shared by all: too short to be worth a group
    a = head + list(range(100, 140))  # system prompt A (40 tokens)
    b = head + list(range(200, 240))
    rows = [a + [500 + i, 600 + i] for i in range(4)] + [b + [700 + i] for i in range(3)] + [[9, 8, 7]]
    r2t = _table(rows)
    lens = [len(r) for r in rows]
    found = find_shared_prefixes(r2t, list(range(len(rows))), lens, min_prefix=8, min_saved=16)
    assert sorted((sorted(m), p) for m, p in found) == [([0, 1, 2, 3], 43), ([4, 5, 6], 43)]


def test_new_token_never_shared_and_singletons_ignored() -> None:
    rows = [list(range(10, 50)), list(range(10, 50))]  # identical rows: share all but the last
    found = find_shared_prefixes(_table(rows), [0, 1], [40, 40], min_prefix=8, min_saved=8)
    assert found == [([0, 1], 39)]
    assert find_shared_prefixes(_table(rows[:1]), [0], [40], min_prefix=1, min_saved=1) == []


def _fb(rpi: list[int], lens: list[int], new_slots: list[int]) -> ForwardBatch:
    n = len(rpi)
    return ForwardBatch(
        input_ids=torch.zeros(n, dtype=torch.int64),
        positions=torch.tensor([x - 1 for x in lens]),
        out_cache_loc=torch.tensor(new_slots),
        req_pool_indices=torch.tensor(rpi),
        seq_lens=torch.tensor(lens),
        extend_seq_lens=[1] * n,
        extend_prefix_lens=[x - 1 for x in lens],
        sampling=SamplingBatchInfo([0.0] * n, [1.0] * n, [-1] * n, [0.0] * n, [None] * n, [0] * n),
    )


@pytest.mark.parametrize("kv_dtype", ["float32", "int8", "fp8_e4m3"])
def test_shared_prefix_attention_equals_plain(kv_dtype: str) -> None:
    """Also over a quantized pool: both paths read the same stored values, dequantized."""
    torch.manual_seed(0)
    H, KVH, D, P = 6, 2, 16, 100  # 3 x 100 tokens saved: over MIN_SAVED_TOKENS
    slots = 2000
    kv = KVPool(slots - 1, 1, 1, KVH, D, kv_format(kv_dtype, torch.float32))
    kv.write(0, torch.arange(slots), torch.randn(slots, KVH, D), torch.randn(slots, KVH, D))
    k_buf, v_buf = kv.read(0, torch.arange(slots), torch.float32)
    prefix = torch.randperm(slots - 1)[:P] + 1
    free = [s for s in range(1, slots) if s not in set(prefix.tolist())]
    r2t = torch.zeros(8, 256, dtype=torch.int64)
    lens = [P + 5, P + 1, P + 30, P + 12, 40, 70]  # four share the prefix, two do not
    new_slots = []
    for i, n in enumerate(lens):
        if i < 4:
            r2t[i, :P] = prefix
            own = [free.pop() for _ in range(n - P)]
            r2t[i, P:n] = torch.tensor(own)
        else:
            r2t[i, :n] = torch.tensor([free.pop() for _ in range(n)])
        new_slots.append(int(r2t[i, n - 1]))

    class Pool:
        req_to_token = r2t

    q = torch.randn(len(lens), H, D)
    k_new = k_buf[torch.tensor(new_slots)].clone()
    v_new = v_buf[torch.tensor(new_slots)].clone()
    outs = {}
    for share in (True, False):
        be = TorchNativeAttention(H, KVH, D)
        be.share_prefixes = share
        fb = _fb(list(range(len(lens))), lens, new_slots)
        be.init_forward_metadata(fb, Pool())  # type: ignore[arg-type]
        assert be._meta is not None and len(be._meta.shared) == (1 if share else 0)
        outs[share] = be.forward(q, k_new, v_new, 0, fb, kv, Pool())  # type: ignore[arg-type]
    torch.testing.assert_close(outs[True], outs[False], rtol=1e-5, atol=1e-5)
