"""The KV tier behind the scheduler's radix cache, with a runner whose outputs read the KV itself:
each token's KV holds its token id and position, and the next token is a function of the request's
whole KV. So a run whose prefixes come back from the tier gives the tier-less run's outputs only if
every loaded slot holds the right KV (and a wrong slot, a shifted row or another prefix's block
changes them). Every drain checks the memory invariant, the tier's accounting included."""

from __future__ import annotations

import errno
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from radixserve.mem.forward_batch import ForwardBatch, ForwardOutput
from radixserve.mem.kv_format import kv_format
from radixserve.mem.kv_pool import KVPool, ReqToTokenPool
from radixserve.mem.kv_tier import KVTier, chain_keys, chain_root
from radixserve.mem.tier_store import FileStore, MemoryStore, TierStore
from radixserve.router.policy import CacheAware, PolicyConfig
from radixserve.sched.kv_tiering import HiCache
from radixserve.sched.req import Req
from radixserve.sched.sampling_params import SamplingParams
from radixserve.sched.tier_events import TierEvents
from radixserve.sim.fleet_events import event_sink
from tests.fakes import VOCAB, drain, make_scheduler

LAYERS = 2


class KVReadingRunner:
    def __init__(self, r2t: ReqToTokenPool, pool: KVPool) -> None:
        self.r2t = r2t
        self.pool = pool

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        if self.pool.format.quantized:
            return self._forward_through_the_format(batch)
        loc = batch.out_cache_loc
        for layer in range(LAYERS):
            k, v = self.pool.k_buffers[layer], self.pool.v_buffers[layer]
            k[loc, 0, 0] = batch.input_ids.float()
            k[loc, 0, 1] = batch.positions.float()
            v[loc, 0, 0] = batch.input_ids.float() * (layer + 2)
            v[loc, 0, 1] = -batch.positions.float()
        out = []
        for i in range(batch.batch_size):
            n = int(batch.seq_lens[i])
            row = self.r2t.req_to_token[int(batch.req_pool_indices[i]), :n]
            pos = torch.arange(n, dtype=torch.float32)
            for layer in range(LAYERS):  # every layer's K and V must agree with each other
                k, v = self.pool.k_buffers[layer][row, 0], self.pool.v_buffers[layer][row, 0]
                if not (torch.equal(v[:, 0], k[:, 0] * (layer + 2)) and torch.equal(v[:, 1], -k[:, 1])):
                    raise AssertionError("a slot's K and V disagree (a half-written load)")
            k = self.pool.k_buffers[LAYERS - 1][row, 0]
            h = int(((k[:, 0] * 7 + k[:, 1] * 3 + 1) * (pos + 1)).sum().item()) + int((k[:, 1] != pos).sum())
            out.append(h % (VOCAB - 1) + 1)
        return ForwardOutput(next_token_ids=out)

    def _forward_through_the_format(self, batch: ForwardBatch) -> ForwardOutput:
        """The same through ``KVPool.write`` / ``read``: a quantized pool's rows (and scales) are what
        the outputs hash, so KV that comes back from the tier changed in any bit shows."""
        ids, pos = batch.input_ids.float(), batch.positions.float()
        for layer in range(LAYERS):
            self.pool.write(layer, batch.out_cache_loc, torch.stack([ids, pos], -1).view(-1, 1, 2) * 0.01,
                            torch.stack([ids * (layer + 2), -pos], -1).view(-1, 1, 2) * 0.01)
        out = []
        for i in range(batch.batch_size):
            row = self.r2t.req_to_token[int(batch.req_pool_indices[i]), : int(batch.seq_lens[i])]
            h = 0.0
            for layer in range(LAYERS):
                k, v = self.pool.read(layer, row, torch.float64)
                h += float((k * 7 + v * 3).sum()) * (layer + 1)
            out.append(int(abs(h) * 1e4) % (VOCAB - 1) + 1)
        return ForwardOutput(next_token_ids=out)


def build(pool_tokens: int, store: TierStore | None, page_size: int = 1, policy: str = "write_back",
          cap: int = 1 << 24, events: TierEvents | None = None, kv_dtype: str = "float32",
          **kw: Any) -> tuple[Any, HiCache | None]:
    holder: dict[str, Any] = {}

    def runner(r2t: ReqToTokenPool) -> KVReadingRunner:
        holder["pool"] = KVPool(pool_tokens, page_size, LAYERS, 1, 2, kv_format(kv_dtype, torch.float32))
        return KVReadingRunner(r2t, holder["pool"])

    sched, _, kv = make_scheduler(pool_tokens=pool_tokens, page_size=page_size, runner=runner,  # type: ignore[arg-type]
                                  context_len=1024, max_reqs=8, **kw)
    hc = None
    if store is not None:
        tier = KVTier(store, model_id=b"t" * 16, block_tokens=8, capacity_bytes=cap)
        hc = HiCache(kv.prefix_tree, kv.allocator, holder["pool"], tier, policy, events=events)
        kv.attach_tier(hc)
    return sched, hc


def prompts() -> list[list[int]]:
    """Four 'conversations' of 90 tokens: A and B share their first 40 tokens."""
    a = [(7 * j) % 900 + 1 for j in range(90)]
    b = a[:40] + [(11 * j) % 900 + 2 for j in range(50)]
    c = [(13 * j) % 900 + 3 for j in range(90)]
    d = [(17 * j) % 900 + 4 for j in range(90)]
    return [a, b, c, d]


def run(sched: Any, order: Sequence[int], new_tokens: int = 4) -> list[list[int]]:
    """The requests one after another (each drains: a later one finds what earlier ones cached)."""
    ps = prompts()
    outs = []
    for n, i in enumerate(order):
        sched.add_request(Req(f"r{n}", ps[i], SamplingParams(max_new_tokens=new_tokens)))
        got = [o for o in drain(sched) if o.rid == f"r{n}"]
        outs.append([t for o in got for t in o.new_token_ids])
    return outs


ORDER = [0, 1, 2, 3, 0, 1, 2, 0]


@pytest.mark.parametrize("policy", ["write_back", "write_through", "write_through_selective"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_prefixes_come_back_from_the_tier_exactly(policy: str, page_size: int) -> None:
    want = run(build(2048, None, page_size)[0], ORDER)  # everything stays in a big pool
    sched, hc = build(160, MemoryStore(), page_size, policy)  # room for one conversation and a bit
    got = run(sched, ORDER)
    assert got == want
    assert hc is not None
    snap = hc.snapshot()
    assert snap["loads"] >= (1 if policy == "write_through_selective" else 3) and snap["hit_tokens"] > 0
    assert snap["corrupt_blocks"] == 0 and snap["loading"] == 0


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_quantized_kv_comes_back_from_the_tier_exactly(kv_dtype: str) -> None:
    """A one-byte pool's blocks carry its values and scales: loaded KV reads back bit for bit."""
    want = run(build(2048, None, 4, kv_dtype=kv_dtype)[0], ORDER)
    sched, hc = build(160, MemoryStore(), 4, "write_through", kv_dtype=kv_dtype)
    assert run(sched, ORDER) == want
    assert hc is not None and hc.snapshot()["loads"] >= 3


def test_a_queued_request_whose_prefix_left_the_pool_loads_it() -> None:
    """A arrives with its prefix in the pool (nothing to load), queued behind C and D, which evict
    that prefix before A runs: A leaves the queue for a load from the tier and runs on it."""
    sched, hc = build(160, MemoryStore(), policy="write_through")
    assert hc is not None
    run(sched, [0])
    ps = prompts()
    reqs = [Req(f"q{i}", ps[i], SamplingParams(max_new_tokens=4)) for i in (2, 3, 0)]
    for r in reqs:
        sched.add_request(r)
    assert hc.snapshot()["loads"] == 0 and not hc.loads  # A's prefix was in the pool when it arrived
    outs = drain(sched)
    a = reqs[2]
    assert hc.snapshot()["loads"] >= 1 and a.cached_tokens >= 64
    assert [t for o in outs if o.rid == "q0" for t in o.new_token_ids] == run(build(2048, None)[0], [0])[0]


def test_without_the_tier_the_small_pool_recomputes() -> None:
    """The figure the tier changes: the same run over the small pool hits far less."""
    sched, _ = build(160, None)
    run(sched, ORDER)
    cold_hits = sched.stats.cached_tokens
    sched2, _ = build(160, MemoryStore())
    run(sched2, ORDER)
    assert sched2.stats.cached_tokens > cold_hits + 200


def stored_on_disk(tmp_path: Any, order: Sequence[int]) -> HiCache:
    """Run ``order`` on a server with a file tier in ``tmp_path`` and stop it (its writes landed)."""
    sched, hc = build(160, FileStore(str(tmp_path)), policy="write_through")
    run(sched, order)
    assert hc is not None
    hc.close()
    return hc


def test_the_file_tier_survives_a_restart(tmp_path: Any) -> None:
    want = run(build(2048, None)[0], [0])
    stored_on_disk(tmp_path, [0])
    sched2, hc2 = build(160, FileStore(str(tmp_path)))  # a new server over the same directory
    assert run(sched2, [0]) == want
    assert hc2 is not None and hc2.snapshot()["hit_tokens"] >= 80


def test_a_corrupt_block_is_computed_again(tmp_path: Any) -> None:
    want = run(build(2048, None)[0], [0])
    stored_on_disk(tmp_path, [0])
    files = sorted(tmp_path.rglob("*.kv"))
    assert len(files) >= 10
    for f in files[::3]:  # damage a third of the blocks, one way or another
        data = f.read_bytes()
        f.write_bytes(data[: len(data) // 2] if len(data) % 2 else data[:-1] + bytes([data[-1] ^ 0xFF]))
    sched2, hc2 = build(160, FileStore(str(tmp_path)))
    assert run(sched2, [0]) == want
    assert hc2 is not None and hc2.snapshot()["corrupt_blocks"] >= 1


class FullDisk(MemoryStore):
    def put(self, key: str, parts: Sequence[Any]) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_only_costs_recomputation() -> None:
    want = run(build(2048, None)[0], ORDER)
    sched, hc = build(160, FullDisk(), policy="write_through")
    assert run(sched, ORDER) == want
    assert hc is not None
    hc.tier.flush_writes()  # writes still queued count as blocks until they fail
    assert hc.snapshot()["write_errors"] > 0 and hc.snapshot()["blocks"] == 0


def test_an_abort_while_loading_ends_the_request_and_keeps_the_kv() -> None:
    sched, hc = build(160, MemoryStore(), policy="write_through")
    run(sched, [0, 2])  # 0's prefix is in the tier, and partly evicted from the pool
    assert hc is not None
    sched.add_request(Req("x", prompts()[0], SamplingParams(max_new_tokens=4)))
    assert sched.kv.loads_pending() == 1 and not sched.queues.waiting
    assert sched.abort_request("x")
    outs = drain(sched)
    assert [type(o.finished_reason).__name__ for o in outs if o.rid == "x" and o.finished_reason] == ["FINISH_ABORT"]
    assert hc.snapshot()["loads"] == 1  # the load landed: the next request finds the prefix in the pool
    assert sched.kv.tree_cache.peek_prefix_len(Req("y", prompts()[0], SamplingParams()).match_key()) >= 80


def test_a_load_waits_for_room_in_the_pool() -> None:
    """Blocks read while the pool is full wait (in memory, the request with them) until a running
    request ends, then land: the request is still served from the tier."""
    want = run(build(2048, None)[0], [0])
    sched, hc = build(160, MemoryStore(), policy="write_through")
    run(sched, [0, 2])
    assert hc is not None
    hog = Req("hog", [5] * 100, SamplingParams(max_new_tokens=50))  # most of the pool while the load lands
    sched.add_request(hog)
    while not hog.kv_indices:
        sched.step()
    sched.add_request(Req("x", prompts()[0], SamplingParams(max_new_tokens=4)))
    waited = False
    outs = []
    while sched.has_work():
        outs += sched.step()
        waited |= bool(hc.staged)
    outs += drain(sched)
    assert waited and {o.rid for o in outs if o.finished_reason} == {"hog", "x"}
    x = [o for o in outs if o.rid == "x"]
    assert [t for o in x for t in o.new_token_ids] == want[0]
    assert hc.snapshot()["loads"] == 1 and hc.snapshot()["loads_no_room"] == 0
    assert max(o.cached_tokens for o in x) >= 80


def test_loaded_requests_run_before_their_kv_is_evicted_again() -> None:
    """Four requests at once over a pool that holds two: the two whose prefixes came back from the
    tier keep them (locked until admitted) and run on them, instead of being pushed out by the
    requests queued before them; every output equals the big pool's."""
    turn2 = [p + [5, 6, 7, 8, 9, 10] for p in prompts()]

    def burst(sched: Any) -> dict[str, tuple[list[int], int]]:
        run(sched, [0, 1, 2, 3])
        for i, p in enumerate(turn2):
            sched.add_request(Req(f"t{i}", p, SamplingParams(max_new_tokens=4)))
        got: dict[str, tuple[list[int], int]] = {}
        for o in drain(sched):
            toks, cached = got.get(o.rid, ([], 0))
            got[o.rid] = (toks + list(o.new_token_ids), max(cached, o.cached_tokens))
        return got

    want = burst(build(2048, None)[0])
    sched, hc = build(200, MemoryStore(), policy="write_through")
    got = burst(sched)
    assert {r: t for r, (t, _) in got.items()} == {r: t for r, (t, _) in want.items()}
    # t0 and t1 load at arrival (t2's load would not fit beside theirs); t3's prefix was in the pool
    # then and may be evicted before t3 runs, and then loads too (when depends on the reader thread)
    assert hc is not None and hc.snapshot()["loads"] in (2, 3)
    assert got["t0"][1] >= 80 and got["t1"][1] >= 80  # served from what the tier loaded


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_tier_events_keep_a_router_in_step_with_the_tier(policy: str) -> None:
    """The tier's cache events (medium "CPU"), applied to a router's cache_aware policy, credit a
    worker with no more of a prompt than its tier can load (consecutive blocks from the start),
    through stores and drops under a small cap; and with all of it when nothing was dropped."""
    router = CacheAware(PolicyConfig())
    sink = event_sink("w0", router, lambda toks: list(toks), lambda: None)
    assert sink is not None
    probe_sched, probe = build(160, MemoryStore(), policy="write_through")  # (write_back writes nothing yet)
    run(probe_sched, [0])
    assert probe is not None
    block_bytes = probe.tier.used_bytes // len(probe.tier)
    for cap in (1 << 24, 12 * block_bytes):
        sched, hc = build(160, MemoryStore(), policy=policy, cap=cap, events=TierEvents(sink, "CPU"))
        assert hc is not None
        router.remove_target("w0")
        run(sched, ORDER)
        root = chain_root(hc.tier.model_id, None)
        credited = []
        for p in prompts():
            keys = chain_keys(root, p, hc.B, len(p) // hc.B)
            held = hc.tier.present_run(keys) * hc.B
            _, per = router.lower.match(p)
            credited.append(per.get("w0", 0))
            assert credited[-1] <= held, (credited[-1], held)
            if cap == 1 << 24:
                assert credited[-1] == held
        assert max(credited) >= (80 if cap == 1 << 24 else 8) and router.tree.tenant_size("w0") == 0  # (no pool events)
        if cap != 1 << 24:
            assert hc.tier.stats.evicted_blocks > 0


def test_a_restarted_tier_reports_the_blocks_it_finds(tmp_path: Any) -> None:
    """A file tier opened over a directory that holds blocks reports their chains when the first
    request arrives: a router following the worker credits it with what its tier can load."""
    hc = stored_on_disk(tmp_path, [0, 1, 2, 3])
    router = CacheAware(PolicyConfig())
    sink = event_sink("w0", router, lambda toks: list(toks), lambda: None)
    assert sink is not None
    (tmp_path / "ab").mkdir(exist_ok=True)
    (tmp_path / "ab" / ("ab" * 16 + ".kv")).write_bytes(b"garbage")  # an unreadable block: left out
    sched2, hc2 = build(160, FileStore(str(tmp_path)), policy="write_through", events=TierEvents(sink, "DISK"))
    assert hc2 is not None and len(hc2.tier.found_at_start) == len(hc.tier) + 1
    assert not router.lower.tenants()  # nothing yet: a router may not be listening at start
    sched2.add_request(Req("first", [1, 2, 3], SamplingParams(max_new_tokens=1)))
    root = chain_root(hc2.tier.model_id, None)
    for p in prompts():
        held = hc2.tier.present_run(chain_keys(root, p, hc2.B, len(p) // hc2.B)) * hc2.B
        assert held >= 80 and router.lower.match(p)[1].get("w0", 0) == held
    drain(sched2)
