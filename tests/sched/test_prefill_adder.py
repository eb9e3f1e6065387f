"""``PrefillAdder``: verdicts for exact budget numbers, and the lock it takes and gives back."""

from __future__ import annotations

import random

import pytest

from radixserve.mem.allocator import TokenToKVPoolAllocator
from radixserve.mem.base_cache import RadixKey
from radixserve.mem.kv_pool import ReqToTokenPool
from radixserve.mem.radix_cache import RadixCache
from radixserve.sched.kv_manager import KVManager
from radixserve.sched.prefill_adder import AddReqResult, PrefillAdder
from radixserve.sched.req import Req
from radixserve.sched.sampling_params import SamplingParams

CONTINUE, NO_TOKEN, OTHER = AddReqResult.CONTINUE, AddReqResult.NO_TOKEN, AddReqResult.OTHER


def make_cache(page_size: int = 1) -> RadixCache:
    return RadixCache(ReqToTokenPool(8, 256), TokenToKVPoolAllocator(256, page_size))


def kv_of(cache: RadixCache) -> KVManager:
    return KVManager(cache.req_to_token_pool, cache.allocator, cache)


def new_req(cache: RadixCache, rid: str, prompt: list[int], max_new: int) -> Req:
    r = Req(rid, prompt, SamplingParams(max_new_tokens=max_new))
    kv_of(cache).match(r)
    return r


def running_req(rid: str, max_new: int, decoded: int) -> Req:
    r = Req(rid, [1, 2, 3], SamplingParams(max_new_tokens=max_new))
    r.output_ids = [5] * decoded
    return r


def cache_prefix(cache: RadixCache, tokens: list[int]) -> None:
    slots = cache.allocator.alloc(len(tokens))
    assert cache.insert(RadixKey(tokens), slots) == 0


def adder(cache: RadixCache, available: int, running: list[Req] | None = None, ratio: float = 0.5,
          max_prefill: int = 1000, chunk: int | None = None, clip: int = 4096) -> PrefillAdder:
    return PrefillAdder(kv_of(cache), available, running or [], ratio, max_prefill, chunk, cache.page_size, clip)


def test_rem_total_reserves_running_requests_remaining_tokens() -> None:
    cache = make_cache()
    running = [running_req("r1", 50, 10), running_req("r2", 10, 0)]  # remaining 40 and 10
    a = adder(cache, 100, running, ratio=0.5)
    assert a.rem_total_token_offset == 25.0  # (40 + 10) * 0.5
    assert a.rem_total_tokens == 75.0
    assert a.budget_state() is CONTINUE
    # The clip caps each running request's reservation.
    assert adder(cache, 100, running, ratio=0.5, clip=8).rem_total_tokens == 100 - (8 + 8) * 0.5
    # Evictable cache counts as available.
    cache_prefix(cache, [9, 9, 9, 9])
    assert a.rem_total_tokens == 79.0


def test_give_back_returns_preempted_requests_reservations() -> None:
    cache = make_cache()
    running = [running_req("r1", 50, 10), running_req("r2", 10, 0)]  # remaining 40 and 10
    a = adder(cache, 100, running, ratio=0.5)
    a.give_back([running[0]], 130)  # r1 preempted: its 20 reserved go, and its KV was freed
    assert a.rem_total_token_offset == 5.0 and a.rem_total_tokens == 125.0


def test_reserve_is_the_same_float_as_summing_request_by_request() -> None:
    """The reserve adds each running request's ``min(remaining, clip) * ratio`` left to right, as
    SGLang's sum does: the same float to the last bit (so admission decisions at the boundary
    match), whatever the ratios and lengths; a finished-past-max request reserves nothing."""
    rng = random.Random(7)
    cache = make_cache()
    for _ in range(300):
        running = [running_req(f"r{i}", rng.randint(1, 3000), rng.randint(0, 3500))
                   for i in range(rng.randint(0, 300))]
        ratio = rng.choice([rng.random(), rng.random() * 1e-3, 0.7, 1.0])
        clip = rng.choice([4096, 64, 1])
        want = 0.0
        for r in running:
            want += min(max(r.max_new_tokens - len(r.output_ids), 0), clip) * ratio
        assert adder(cache, 10**6, running, ratio=ratio, clip=clip).rem_total_token_offset == want


def test_no_token_when_prompt_plus_reserve_reaches_rem_total() -> None:
    cache = make_cache()
    running = [running_req("r1", 50, 10), running_req("r2", 10, 0)]
    # 30 + 45 == 75: the check is ">=", so exactly the budget is refused.
    a = adder(cache, 100, running)
    assert a.add_one_req(new_req(cache, "x", list(range(100, 130)), 45)) is NO_TOKEN
    assert a.can_run_list == [] and a.rem_total_tokens == 75.0
    # 30 + 44 == 74 fits and leaves exactly 1.
    ok = new_req(cache, "a", list(range(100, 130)), 44)
    assert a.add_one_req(ok) is CONTINUE
    assert a.can_run_list == [ok]
    assert a.rem_total_tokens == 1.0
    assert a.rem_input_tokens == 970
    b = new_req(cache, "b", [7], 1)  # 1 + 1 >= 1
    assert a.add_one_req(b) is NO_TOKEN
    assert a.can_run_list == [ok]
    # max_new_tokens is clipped when reserving for a new request too.
    c = adder(cache, 100, running, clip=10)
    assert c.rem_total_tokens == 100 - (10 + 10) * 0.5
    big = new_req(cache, "big", list(range(100, 150)), 1000)  # 50 + min(1000, 10) = 60 < 90
    assert c.add_one_req(big) is CONTINUE
    assert c.rem_total_token_offset == (10 + 10) * 0.5 + 60


def test_budget_state_no_token_when_running_reservation_exceeds_memory() -> None:
    cache = make_cache()
    a = adder(cache, 10, [running_req("r", 100, 0)], ratio=0.5)
    assert a.rem_total_tokens == -40.0
    assert a.budget_state() is NO_TOKEN
    assert adder(cache, 10, [running_req("r", 100, 80)], ratio=0.5).budget_state() is NO_TOKEN  # 10 - 20*0.5 == 0
    assert adder(cache, 10, [running_req("r", 100, 90)], ratio=0.5).budget_state() is CONTINUE  # 10 - 10*0.5


def test_cached_prefix_is_locked_on_admission_and_leaves_rem_total() -> None:
    cache = make_cache()
    cache_prefix(cache, list(range(1, 11)))
    assert cache.evictable_size() == 10
    a = adder(cache, 20, ratio=0.7)
    assert a.rem_total_tokens == 30
    r = new_req(cache, "a", list(range(1, 16)), 5)
    assert (len(r.prefix_indices), r.extend_input_len) == (10, 5)
    node = r.last_node
    assert node.lock_ref == 0
    assert a.add_one_req(r) is CONTINUE
    assert node.lock_ref == 1
    assert (cache.evictable_size(), cache.protected_size()) == (0, 10)
    assert a.rem_total_tokens == 20 - (5 + 5)  # the locked prefix is no longer evictable
    assert a.rem_input_tokens == 1000 - 5  # only the extend counts as prefill input
    cache.check_integrity()


def test_lock_is_released_on_rejection() -> None:
    cache = make_cache()
    cache_prefix(cache, list(range(1, 11)))
    # 5 free + 10 evictable = 15 > 5 + 5 before the lock, but the lock takes the prefix out: 5 left.
    a = adder(cache, 5)
    r = new_req(cache, "a", list(range(1, 16)), 5)
    assert a.add_one_req(r) is NO_TOKEN
    assert r.last_node.lock_ref == 0
    assert (cache.evictable_size(), cache.protected_size()) == (10, 0)
    assert a.can_run_list == []
    assert a.rem_total_tokens == 15
    cache.check_integrity()


def test_first_request_may_exceed_rem_input_tokens() -> None:
    cache = make_cache()
    a = adder(cache, 1000, max_prefill=10)
    big = new_req(cache, "big", list(range(100, 120)), 4)
    assert a.add_one_req(big) is OTHER  # admitted, and the input budget is now spent
    assert a.can_run_list == [big]
    assert a.rem_input_tokens == -10
    assert a.budget_state() is OTHER

    cache_prefix(cache, list(range(1, 11)))
    b = adder(cache, 1000, max_prefill=10)
    first = new_req(cache, "first", [50, 51, 52, 53], 4)
    assert b.add_one_req(first) is CONTINUE
    assert b.rem_input_tokens == 6
    second = new_req(cache, "second", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 60, 61, 62, 63, 64, 65, 66], 4)
    assert second.extend_input_len == 7
    assert b.add_one_req(second) is OTHER  # 7 > 6 and not the first: refused
    assert b.can_run_list == [first]
    assert second.last_node.lock_ref == 0 and cache.protected_size() == 0
    third = new_req(cache, "third", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 70, 71, 72, 73, 74, 75], 4)
    assert third.extend_input_len == 6
    assert b.add_one_req(third) is OTHER  # fits exactly; the budget is now 0
    assert b.can_run_list == [first, third]
    assert b.rem_input_tokens == 0
    assert third.last_node.lock_ref == 1
    cache.check_integrity()


def test_chunk_budget_truncates_into_new_chunked_req() -> None:
    cache = make_cache()
    a = adder(cache, 100, chunk=8)
    r = new_req(cache, "long", list(range(100, 120)), 10)
    assert a.add_one_req(r) is OTHER  # the chunk budget is spent
    assert a.new_chunked_req is r and r.is_chunked
    assert r.extend_input_len == 8
    assert a.rem_chunk_tokens == 0
    assert a.rem_input_tokens == 992
    assert a.rem_total_token_offset == 8  # a chunk reserves no output yet
    assert a.can_run_list == [r]


def test_chunk_truncation_is_page_aligned() -> None:
    cache = make_cache(page_size=4)
    a = adder(cache, 200, chunk=8)
    first = new_req(cache, "first", [1, 2], 4)
    assert first.extend_input_len == 2
    assert a.add_one_req(first) is CONTINUE
    assert a.rem_chunk_tokens == 6
    long = new_req(cache, "long", list(range(100, 113)), 4)
    assert a.add_one_req(long) is CONTINUE  # 13 > 6: cut to 4 (whole pages); 2 chunk tokens left
    assert (long.extend_input_len, long.is_chunked, a.new_chunked_req) == (4, True, long)
    assert a.rem_chunk_tokens == 2
    assert a.rem_total_token_offset == (4 + 4) + 4  # first: 2 tokens take a whole page (+4 reserved)
    other = new_req(cache, "other", list(range(200, 209)), 4)
    assert a.add_one_req(other) is OTHER  # 9 > 2 and 2 rounds down to 0 pages
    assert not other.is_chunked and other.extend_input_len == 9
    assert a.can_run_list == [first, long]
    assert a.new_chunked_req is long


def test_chunk_truncation_after_a_page_aligned_prefix() -> None:
    cache = make_cache(page_size=4)
    slots = cache.allocator.alloc(8)
    cache.insert(RadixKey(list(range(100, 108))), slots)
    a = adder(cache, 200, chunk=8)
    r = new_req(cache, "r", list(range(100, 130)), 4)
    assert (len(r.prefix_indices), r.extend_input_len) == (8, 22)
    assert a.add_one_req(r) is OTHER
    assert r.extend_input_len == 8 and r.is_chunked
    assert r.last_node.lock_ref == 1


@pytest.mark.parametrize("chunk, expect_len, still_chunked", [(8, 8, True), (12, 12, False), (16, 12, False)])
def test_add_chunked_req(chunk: int, expect_len: int, still_chunked: bool) -> None:
    cache = make_cache()
    r = Req("c", list(range(100, 120)), SamplingParams(max_new_tokens=30))
    r.kv_indices = list(range(1, 9))  # 8 of 20 computed in earlier chunks
    kv_of(cache).match(r)
    assert r.extend_input_len == 12
    a = adder(cache, 100, chunk=chunk)
    back = a.add_chunked_req(r)
    assert r.extend_input_len == expect_len
    assert r.is_chunked is still_chunked
    assert back is (r if still_chunked else None)
    assert a.can_run_list == [r]
    assert a.rem_chunk_tokens == chunk - expect_len
    assert a.rem_total_token_offset == expect_len + (0 if still_chunked else 30)
    assert a.budget_state() is (OTHER if chunk == expect_len else CONTINUE)


def test_no_chunking_when_disabled() -> None:
    cache = make_cache()
    a = adder(cache, 1000, chunk=None)
    r = new_req(cache, "r", list(range(100, 400)), 4)
    assert a.add_one_req(r) is CONTINUE
    assert r.extend_input_len == 300 and not r.is_chunked and a.new_chunked_req is None


def test_memory_budget_counts_whole_pages() -> None:
    cache = make_cache(page_size=8)
    a = adder(cache, 32)
    first = new_req(cache, "first", list(range(100, 117)), 2)  # 17 tokens: 3 pages
    assert a.add_one_req(first) is CONTINUE
    assert a.rem_total_token_offset == 24 + 2
    assert a.rem_total_tokens == 6
    second = new_req(cache, "second", list(range(200, 209)), 2)  # 9 tokens: 2 pages, only 1 left
    assert a.add_one_req(second) is NO_TOKEN
    assert a.can_run_list == [first]
