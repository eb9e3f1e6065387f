"""``KVManager`` alone: the one door to KV memory keeps the accounting exact for the scheduler's
requests and for KV that comes from outside (prefill/decode disaggregation), with or without a
radix cache."""

from __future__ import annotations

import pytest

from radixserve.config import ServerArgs
from radixserve.mem.base_cache import ChunkCache, RadixKey
from radixserve.mem.cache_events import AllCleared, BlockRemoved, BlockStored, CacheEvent
from radixserve.mem.evict_policy import QueueAwareStrategy
from radixserve.mem.radix_cache import RadixCache
from radixserve.sched.build import build_kv
from radixserve.sched.kv_manager import KVManager
from radixserve.sched.req import Req
from radixserve.sched.sampling_params import SamplingParams


def make_kv(radix: bool = True, page_size: int = 1, total: int = 64, **kw: object) -> KVManager:
    args = ServerArgs(page_size=page_size, disable_radix_cache=not radix, **kw)  # type: ignore[arg-type]
    return build_kv(args, total, 48, max_reqs=4)


def run_to_end(kv: KVManager, req: Req, new_tokens: int = 2) -> None:
    """Admit ``req`` as the scheduler does, compute its prompt and ``new_tokens`` more, release it."""
    kv.match(req)
    kv.lock_match(req)
    kv.admit(req)
    kv.grow(req, req.extend_input_len)
    for t in range(new_tokens):
        req.output_ids.append(900 + t)
        kv.grow(req, 1)
    kv.release(req)


def req(rid: str, prompt: list[int]) -> Req:
    return Req(rid, prompt, SamplingParams(max_new_tokens=8))


@pytest.mark.parametrize("radix", [True, False])
def test_requests_leave_nothing_behind(radix: bool) -> None:
    kv = make_kv(radix)
    run_to_end(kv, req("a", list(range(1, 11))))
    run_to_end(kv, req("b", list(range(1, 11)) + [50, 51]))
    kv.check_invariant()
    # a: 10 prompt + 2 output tokens; b shares a's 10-token prompt and adds 2 + 2 of its own
    assert kv.evictable_size() == (12 + 4 if radix else 0)
    assert kv.prefix_tree is (kv.tree_cache if radix else None)


def test_uncached_tokens_is_a_read_only_look() -> None:
    kv = make_kv()
    run_to_end(kv, req("a", list(range(1, 11))), new_tokens=0)
    nodes = len(kv.tree_cache.root.children)
    waiting = req("b", list(range(1, 6)) + [70, 71])
    assert kv.uncached_tokens(waiting) == 2  # 5 of its 7 tokens are cached
    assert len(kv.tree_cache.root.children) == nodes and kv.protected_size() == 0  # no split, no lock
    assert waiting.last_node is None and len(waiting.prefix_indices) == 0
    assert kv.uncached_tokens(req("c", [1])) == 1  # at least one token is always computed
    chunk = make_kv(radix=False)
    assert chunk.uncached_tokens(req("d", list(range(1, 11)))) == 10


def test_exclusive_cached_tokens_counts_only_what_one_request_pins() -> None:
    kv = make_kv()
    run_to_end(kv, req("a", list(range(1, 11))), new_tokens=0)  # caches 10 tokens
    x, y = req("x", list(range(1, 11)) + [5], ), req("y", list(range(1, 6)) + [8, 9])
    for r in (x, y):
        kv.match(r)
        kv.lock_match(r)
    assert kv.exclusive_cached_tokens(x) == 5  # tokens 1-5 are pinned by y too
    assert kv.exclusive_cached_tokens(y) == 0
    for r in (x, y):
        kv.unlock_match(r)
        kv.release(r)
    kv.check_invariant()
    assert make_kv(radix=False).exclusive_cached_tokens(x) == 0


def test_mark_wanted_reaches_a_queue_aware_strategy_only() -> None:
    kv = make_kv(radix_eviction_policy="queue-aware")
    run_to_end(kv, req("a", [1, 2, 3, 4]), new_tokens=0)
    run_to_end(kv, req("b", [7, 8, 9]), new_tokens=0)
    kv.mark_wanted([req("w", [7, 8, 9, 10])])
    strategy = kv.tree_cache.strategy  # type: ignore[attr-defined]
    assert isinstance(strategy, QueueAwareStrategy)
    (b_node,) = [c for c in kv.tree_cache.root.children.values() if c.key[0] == 7]
    assert strategy.wanted == {b_node.id}
    kv.tree_cache.evict(3)  # the unwanted branch goes first
    assert [c.key[0] for c in kv.tree_cache.root.children.values()] == [7]
    make_kv(radix=False).mark_wanted([req("w", [1, 2])])  # nothing to mark, nothing raised


def test_reserve_adopt_unlock_round_trip() -> None:
    kv = make_kv(page_size=2, total=32)
    run_to_end(kv, req("a", [1, 2, 3, 4]), new_tokens=0)  # [1,2,3,4] cached: a duplicate later
    free_before = kv.available_size()
    slots = kv.reserve(7)  # whole pages: 8 slots
    assert len(slots) == 8 and kv.available_size() == free_before - 8 and kv.held_outside()
    hold = kv.adopt([1, 2, 3, 4, 5, 6, 7], slots, 6)  # 6 tokens arrived (whole pages)
    # the duplicate [1..4] and the tail past 6 went back; the new page [5, 6] is cached and pinned
    assert kv.available_size() == free_before - 2
    assert kv.protected_size() == 6 and kv.held_outside()
    assert kv.cached_slots([1, 2, 3, 4, 5, 6])[4:] == slots[4:6]
    kv.unlock(hold)
    assert not kv.held_outside()
    kv.check_invariant()
    other = kv.reserve(3)
    assert kv.held_outside()
    kv.unreserve(other)
    assert not kv.held_outside() and kv.available_size() == free_before - 2
    kv.check_invariant()


def test_reserve_evicts_cache_leaves_when_free_slots_run_out() -> None:
    kv = make_kv(total=16)
    run_to_end(kv, req("a", list(range(1, 13))), new_tokens=0)  # 12 of 16 cached
    assert kv.available_size() == 4
    slots = kv.reserve(10)
    assert len(slots) == 10 and kv.evictable_size() <= 6
    kv.unreserve(slots)
    kv.check_invariant()


def test_the_event_sink_is_given_at_build_time() -> None:
    events: list[CacheEvent] = []
    args = ServerArgs()
    kv = build_kv(args, 32, 16, max_reqs=2, event_sink=events.append)
    assert events == []  # building the empty tree reports nothing
    run_to_end(kv, req("a", [1, 2, 3]), new_tokens=0)
    kv.flush()
    assert [type(e) for e in events] == [BlockStored, BlockRemoved, AllCleared]
    assert isinstance(kv.tree_cache, RadixCache)


def test_chunk_cache_answers_none_for_every_question() -> None:
    kv = make_kv(radix=False)
    assert isinstance(kv.tree_cache, ChunkCache)
    assert kv.tree_cache.peek_prefix_len(RadixKey([1, 2, 3])) == 0
    assert kv.evicted() == (0, 0)


@pytest.mark.parametrize("page_size", [1, 4])
def test_truncate_frees_whole_pages_past_the_kept_slots(page_size: int) -> None:
    """Rejected drafts' slots: ``truncate`` keeps the first n, frees the pages wholly past them, keeps
    the rest of the n-th slot's page (the next ``grow`` writes over it) and never cuts the cached prefix."""
    kv = make_kv(page_size=page_size, total=64)
    r = req("r", list(range(1, 7)))
    kv.match(r)
    kv.lock_match(r)
    kv.admit(r)
    kv.grow(r, 6)
    free0 = kv.available_size()
    kv.grow(r, 9)  # 15 slots: the last token's and eight drafts past a 7th
    kv.truncate(r, 8)
    assert len(r.kv_indices) == 8
    assert kv.available_size() == free0 - (2 if page_size == 1 else 0)  # pages of 4: slots 0-7 fill the same two
    again = kv.grow(r, 3)  # the next step continues right after the kept slots
    assert r.kv_indices[8:] == again and len(set(r.kv_indices)) == 11
    r.output_ids = [500] * 6  # 12 tokens: KV for all but the last
    kv.truncate(r, 11)
    kv.release(r)
    kv.check_invariant()
    with pytest.raises(ValueError, match="cached prefix"):
        other = req("o", list(range(1, 7)) + [40])
        kv.match(other)
        kv.lock_match(other)
        kv.admit(other)
        kv.truncate(other, 0)
