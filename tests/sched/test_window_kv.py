"""A model whose every layer has a sliding window: the scheduler frees each request's KV behind the
window as it grows, the window it still reads is always intact, and nothing leaks.

``WindowRunner`` keeps what a real pool would hold: each slot it writes remembers its position and
a hash of the whole token sequence up to it (chained through the slot of the position before).
Before every forward each row's window is read back: a slot freed too early and handed to another
request, or a wrong slot in the table, shows as a wrong position or a broken chain."""

from __future__ import annotations

import pytest

from radixserve.config import ServerArgs
from radixserve.mem.allocator import TokenToKVPoolAllocator
from radixserve.mem.forward_batch import ForwardBatch, ForwardOutput
from radixserve.mem.kv_pool import ReqToTokenPool
from radixserve.sched.build import build_kv
from radixserve.sched.core import SchedulerCore
from radixserve.sched.req import Req
from radixserve.sched.sampling_params import SamplingParams
from tests.fakes import EchoRunner, expected_tokens, make_scheduler
from tests.sched.sched_helpers import prompt

W = 12  # the window (positions a token attends, itself included)


class WindowRunner(EchoRunner):
    def __init__(self, pool: ReqToTokenPool) -> None:
        super().__init__(pool)
        self.kv: dict[int, tuple[int, int, int]] = {}  # slot -> (position, hash before it, hash with it)
        self.reads = 0
        self.allocator: TokenToKVPoolAllocator | None = None  # set by the test: slots read must be handed out

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        assert self.pool is not None
        ids, loc = batch.input_ids.tolist(), batch.out_cache_loc.tolist()
        off = 0
        for i, n in enumerate(batch.extend_seq_lens):
            row = self.pool.req_to_token[int(batch.req_pool_indices[i])].tolist()
            p = batch.extend_prefix_lens[i]
            # the positions before the new tokens that the first of them attends
            for q in range(max(0, p + 1 - W), p):
                pos, before, _ = self.kv[row[q]]
                assert pos == q, f"the slot of position {q} holds position {pos}: freed and reused too early"
                assert self.allocator is None or self.allocator.is_handed_out(row[q]), f"position {q}'s slot is free"
                if q > max(0, p + 1 - W):
                    assert before == self.kv[row[q - 1]][2], f"the KV at position {q} is another sequence's"
                self.reads += 1
            h = self.kv[row[p - 1]][2] if p else 0
            for j in range(n):
                new = hash((h, ids[off + j]))
                self.kv[loc[off + j]] = (p + j, h, new)
                h = new
            off += n
        return super().forward(batch)


def _run(sched: SchedulerCore, reqs: list[Req], overlap: bool) -> dict[str, list[int]]:
    for r in reqs:
        sched.add_request(r)
    seen: dict[str, list[int]] = {}
    for _ in range(5000):
        for o in sched.step_overlapped() if overlap else sched.step():
            seen.setdefault(o.rid, []).extend(o.new_token_ids)
        if not sched.has_work():
            sched.step_overlapped() if overlap else sched.step()  # the idle step's self-check
            sched.kv.check_invariant()
            return seen
    raise AssertionError("did not drain")


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("scheduler", ["sglang", "unified"])
@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_kv_behind_the_window_is_freed_and_the_window_kept(page: int, scheduler: str, overlap: bool) -> None:
    """Long outputs (many windows) from prompts shorter and longer than the window, two of them
    sharing a cached prefix: the same tokens as without the window, each request's KV stays within
    its cached prompt plus a window (and a page), and everything is given back."""
    prompts = [prompt(0, 5), prompt(1, 30), prompt(1, 30)[:20] + prompt(2, 9), prompt(3, 12)]
    sched, runner, kv = make_scheduler(pool_tokens=400, page_size=page, runner=WindowRunner, window=W,
                                       scheduler=scheduler, chunked_prefill_size=16)
    assert isinstance(runner, WindowRunner)
    runner.allocator = kv.allocator
    reqs = [Req(f"r{i}", p, SamplingParams(max_new_tokens=60 + 7 * i)) for i, p in enumerate(prompts)]
    peak: dict[str, int] = {}
    real = kv.grow_decode

    def grow_decode(rs: list[Req]) -> tuple[list[int], list[int]]:
        out = real(rs)
        for r in rs:
            peak[r.rid] = max(peak.get(r.rid, 0), r.own_kv_tokens)
        return out

    kv.grow_decode = grow_decode  # type: ignore[method-assign]
    seen = _run(sched, reqs, overlap)
    for i, p in enumerate(prompts):
        assert seen[f"r{i}"] == expected_tokens(p, 60 + 7 * i)
    assert runner.reads > 0
    if scheduler == "sglang":  # (the unified scheduler grows decode rows one by one: kv.grow)
        assert peak and max(peak.values()) <= W + 2 * page


def test_without_a_window_nothing_is_freed_early() -> None:
    sched, _, kv = make_scheduler(pool_tokens=400, runner=WindowRunner)
    req = Req("a", prompt(0, 5), SamplingParams(max_new_tokens=40))
    _run(sched, [req], overlap=False)
    assert req.kv_freed_to == 0 and kv.window is None


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("radix", [True, False])
@pytest.mark.parametrize("end", ["release", "discard"])
def test_a_request_with_freed_kv_caches_only_its_whole_prefix(page: int, radix: bool, end: str) -> None:
    """KVManager alone: a request grows far past the window; what it holds stays within a window
    (and a page) past its cached prompt; ending it (finish or retraction: ``release``; a failed
    forward: ``discard``) caches only the prompt, frees the rest, and the accounting is exact."""
    args = ServerArgs(page_size=page, disable_radix_cache=not radix)
    kv = build_kv(args, 96, 128, max_reqs=2, window=W)
    r = Req("a", list(range(1, 9)), SamplingParams(max_new_tokens=80))
    kv.match(r)
    kv.lock_match(r)
    kv.admit(r)
    kv.grow(r, r.extend_input_len)
    if radix:
        kv.cache_unfinished(r)  # the prompt, shareable (as the scheduler does after a prefill)
    for t in range(60):
        r.output_ids.append(500 + t)
        kv.grow(r, 1)
        own = -(-len(r.kv_indices) // page) * page - max(r.kv_freed_to, r.cache_protected_len)  # whole pages
        assert own <= W + 2 * page
        assert kv.allocator.available_size() + kv.evictable_size() + kv.protected_size() + own == 96
    assert r.kv_freed_to > r.cache_protected_len
    (kv.release if end == "release" else kv.discard)(r)
    kv.check_invariant()
    cached = 8 // page * page if radix else 0
    assert kv.evictable_size() == cached and kv.allocator.available_size() == 96 - cached
    assert r.kv_freed_to == 0 and r.kv_indices == []


class LocalWindowRunner(EchoRunner):
    """A model with a global layer and a sliding one, each with the KV of its own slots: every slot
    written remembers (position, hash before it, hash with it), in the main slots for the global
    layer and in the window slots (``window_kv.translate``) for the sliding one. Before every
    forward each row's whole past is read back through the main table and its window through the
    twin table: the window slot must hold the very record the main slot holds (a window page given
    back too early and reused, a stale twin entry or the padding page all show)."""

    def __init__(self, pool: ReqToTokenPool) -> None:
        super().__init__(pool)
        self.main: dict[int, tuple[int, int, int]] = {}
        self.local: dict[int, tuple[int, int, int]] = {}
        self.reads = 0

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        pool = self.pool
        assert pool is not None and pool.window is not None and pool.window_kv is not None
        ids, loc = batch.input_ids.tolist(), batch.out_cache_loc.tolist()
        wloc = pool.window_kv.translate(batch.out_cache_loc).tolist()
        ps = pool.window_kv.page_size
        assert min(wloc, default=ps) >= ps, "a new token's sliding-layer KV would go to the padding page"
        off = 0
        for i, n in enumerate(batch.extend_seq_lens):
            r = int(batch.req_pool_indices[i])
            p = batch.extend_prefix_lens[i]
            row, wrow = pool.req_to_token[r, :p].tolist(), pool.window.req_to_token[r, :p].tolist()
            for q in range(p):  # the global layer reads every position
                pos, before, _ = self.main[row[q]]
                assert pos == q and (q == 0 or before == self.main[row[q - 1]][2]), f"main KV at {q} is wrong"
            page_of = pool.window_kv.page_of
            for q in range(max(0, p + 1 - LW), p):  # the sliding layer, its window
                held = int(page_of[row[q] // ps])
                assert held and wrow[q] == held * ps + row[q] % ps, f"position {q}'s window page was given back"
                assert self.local.get(wrow[q]) == self.main[row[q]], f"the window's KV at position {q} is not its own"
                self.reads += 1
            h = self.main[row[p - 1]][2] if p else 0
            for j in range(n):
                new = hash((h, ids[off + j]))
                self.main[loc[off + j]] = self.local[wloc[off + j]] = (p + j, h, new)
                h = new
            off += n
        return super().forward(batch)


LW = 12  # the sliding layers' window in the tests below


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("scheduler", ["sglang", "unified"])
@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_sliding_layers_keep_a_window_of_their_own_slots(page: int, scheduler: str, overlap: bool) -> None:
    """Sliding layers among global ones: long outputs, chunked prompts, prompts sharing cached
    prefixes (a second wave leaves the first wave's prompts before, at and after their ends): the
    same tokens as without windows, every window read whole, the window pages in use bounded by a
    window per request and per cached stretch, and everything given back."""
    first = [prompt(0, 5), prompt(1, 30), prompt(1, 30)[:20] + prompt(2, 9), prompt(3, 12)]
    second = [prompt(1, 30), prompt(1, 30)[:27] + prompt(4, 6), prompt(1, 30) + prompt(5, 3), prompt(3, 12)]
    sched, runner, kv = make_scheduler(pool_tokens=600, page_size=page, runner=LocalWindowRunner, local_window=LW,
                                       scheduler=scheduler, chunked_prefill_size=16)
    assert isinstance(runner, LocalWindowRunner) and kv.window_kv is not None
    wkv = kv.window_kv
    peak = 0
    real = kv.grow_decode

    def grow_decode(rs: list[Req]) -> tuple[list[int], list[int]]:
        nonlocal peak
        out = real(rs)
        for r in rs:  # its own positions whose pages still have window pages
            own = r.kv_indices[r.cache_protected_len :]
            peak = max(peak, sum(1 for s in own if wkv.page_of[s // page]))
        return out

    kv.grow_decode = grow_decode  # type: ignore[method-assign]
    for wave, prompts in enumerate((first, second)):
        reqs = [Req(f"r{wave}{i}", p, SamplingParams(max_new_tokens=50 + 7 * i)) for i, p in enumerate(prompts)]
        seen = _run(sched, reqs, overlap)
        for i, p in enumerate(prompts):
            assert seen[f"r{wave}{i}"] == expected_tokens(p, 50 + 7 * i)
        # at rest the cache holds every position for the global layers, a few windows for the sliding ones
        assert wkv.used_pages() * page < kv.evictable_size() / 2
    assert sum(r.cached_tokens for r in reqs) > 0
    assert runner.reads > 0
    if scheduler == "sglang":  # (the unified scheduler grows decode rows one by one: kv.grow)
        assert 0 < peak <= LW + 2 * page
