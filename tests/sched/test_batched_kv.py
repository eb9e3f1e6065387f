"""Batched decode KV allocation and request-table writes equal the per-request ones exactly."""

from __future__ import annotations

import random

import pytest
import torch

from radixserve.mem.allocator import OutOfKVSlots, TokenToKVPoolAllocator
from radixserve.mem.base_cache import RadixKey
from radixserve.mem.kv_pool import ReqToTokenPool
from radixserve.mem.radix_cache import RadixCache
from radixserve.sched.kv_manager import KVManager
from radixserve.sched.req import Req


def test_write_many_equals_per_request_writes() -> None:
    a, b = ReqToTokenPool(6, 16), ReqToTokenPool(6, 16)
    rows, cols, slots = [0, 3, 5, 1], [0, 7, 15, 2], [11, 12, 13, 14]
    for r, c, s in zip(rows, cols, slots, strict=True):
        a.write(r, c, [s])
    b.write_many(rows, cols, slots)
    assert torch.equal(a.req_to_token, b.req_to_token)
    b.write_many([], [], [])  # nothing to do


@pytest.mark.parametrize("page_size", [1, 2])
def test_take_pages_in_turn_equals_one_page_at_a_time(page_size: int) -> None:
    rng = random.Random(page_size)
    a, b = TokenToKVPoolAllocator(64, page_size), TokenToKVPoolAllocator(64, page_size)
    for _ in range(40):
        n = rng.randrange(0, 5)
        if a.available_size() // page_size >= n:
            got = a.take_pages_in_turn(n, lambda _: 0)
            want = [b._take_pages(1)[0] for _ in range(n)]
            assert got == want
        held = [p for p in range(1, a.num_pages + 1) if not a._is_free[p]]
        for p in rng.sample(held, min(len(held), rng.randrange(0, 4))):
            a.free([p * page_size])
            b.free([p * page_size])
    with pytest.raises(OutOfKVSlots):
        TokenToKVPoolAllocator(4, 1).take_pages_in_turn(5, lambda _: 0)


def _setup(page_size: int) -> tuple[KVManager, list[Req]]:
    r2t = ReqToTokenPool(8, 64)
    alloc = TokenToKVPoolAllocator(96, page_size)
    cache = RadixCache(r2t, alloc)
    kv = KVManager(r2t, alloc, cache)
    for i in range(6):  # fill the pool with cached prompts, so decoding must evict
        n = 12 - 12 % page_size
        cache.insert(RadixKey([100 + i] * n), alloc.alloc(n))
    reqs = []
    for i in range(5):
        req = Req(f"r{i}", [i + 1] * (3 + i))
        kv.match(req)
        kv.lock_match(req)
        kv.admit(req)
        kv.grow(req, req.extend_input_len)
        reqs.append(req)
    return kv, reqs


@pytest.mark.parametrize("page_size", [1, 4])
def test_grow_decode_equals_grow_one_by_one(page_size: int) -> None:
    kv_a, reqs_a = _setup(page_size)
    kv_b, reqs_b = _setup(page_size)
    for _ in range(9):
        cols, slots = kv_a.grow_decode(reqs_a)
        want_cols = [len(r.kv_indices) for r in reqs_b]
        want = [s for r in reqs_b for s in kv_b.grow(r, 1)]
        assert (cols, slots) == (want_cols, want)
        assert [r.kv_indices for r in reqs_a] == [r.kv_indices for r in reqs_b]
        assert torch.equal(kv_a.req_to_token_pool.req_to_token, kv_b.req_to_token_pool.req_to_token)
        assert kv_a.tree_cache.evictable_size() == kv_b.tree_cache.evictable_size()
        assert kv_a.available_size() == kv_b.available_size()
        assert kv_a.decode_tokens_needed(reqs_a, 3) == sum(
            kv_a.allocator.pages_needed(len(r.kv_indices), 3) for r in reqs_a) * page_size
    kv_a.tree_cache.check_integrity()
