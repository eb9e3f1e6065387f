"""``--schedule-policy``: exact orders for fcfs, lof, random, lpm (fallback, in-batch prefix
caching, incremental matches) and dfs-weight (seed 000's worked example), and outputs that never
depend on the policy. Every scenario that drains checks the KV invariant (``drain`` does)."""

from __future__ import annotations

import random

import pytest

from radixserve.bench.policy_bench import bench_lpm_order
from radixserve.config import SCHEDULE_POLICIES
from radixserve.mem.allocator import TokenToKVPoolAllocator
from radixserve.mem.base_cache import RadixKey
from radixserve.mem.kv_pool import ReqToTokenPool
from radixserve.mem.radix_cache import RadixCache
from radixserve.sched.policies import PolicyContext, get_policy, policy_names
from radixserve.sched.policies.prefix_match import PrefixLengthCache, in_batch_deprioritized
from radixserve.sched.priority import PrioritySettings
from radixserve.sched.req import Req
from radixserve.sched.sampling_params import SamplingParams
from tests.fakes import drain, make_scheduler
from tests.sched.policy_helpers import BatchLog, assert_exact, prompt, submit


def test_every_policy_is_registered() -> None:
    assert sorted(SCHEDULE_POLICIES) == policy_names()


# --- cache-agnostic ----------------------------------------------------------------------------


def test_fcfs_orders_by_arrival_not_submission() -> None:
    sched, _, _ = make_scheduler(schedule_policy="fcfs")
    log = BatchLog(sched)
    reqs = [submit(sched, rid, prompt(i, 6), arrival=t) for i, (rid, t) in enumerate([("c", 3.0), ("a", 1.0), ("b", 2.0)])]
    outs = drain(sched)
    assert log.rids(0) == ["a", "b", "c"]
    assert_exact(outs, reqs)


def test_lof_longest_output_first_ties_by_arrival() -> None:
    sched, _, _ = make_scheduler(schedule_policy="lof")
    log = BatchLog(sched)
    reqs = [submit(sched, rid, prompt(i, 6), max_new=n) for i, (rid, n) in enumerate(
        [("a", 3), ("b", 9), ("c", 5), ("d", 9), ("e", 1)])]
    outs = drain(sched)
    assert log.rids(0) == ["b", "d", "c", "a", "e"]
    assert_exact(outs, reqs)


def test_random_is_a_seeded_permutation() -> None:
    orders = []
    for _ in range(2):
        sched, _, _ = make_scheduler(schedule_policy="random", random_seed=7)
        log = BatchLog(sched)
        reqs = [submit(sched, f"r{i}", prompt(i, 6)) for i in range(8)]
        outs = drain(sched)
        assert sorted(log.rids(0)) == sorted(r.rid for r in reqs)
        assert_exact(outs, reqs)
        orders.append(log.rids(0))
    assert orders[0] == orders[1] and orders[0] != sorted(orders[0])


# --- lpm ---------------------------------------------------------------------------------------


def _warm(sched, *prompts: list[int]) -> None:  # type: ignore[no-untyped-def]
    """Run each prompt for one token so exactly the prompt is cached."""
    for i, p in enumerate(prompts):
        submit(sched, f"warm{i}", p, max_new=1)
    drain(sched)


def test_lpm_longest_cached_prefix_first() -> None:
    sched, _, _ = make_scheduler(pool_tokens=512, schedule_policy="lpm")
    base = prompt(100, 30)
    _warm(sched, base)
    log = BatchLog(sched)
    spec = [("a", 5), ("b", 20), ("c", 0), ("d", 20), ("e", 12)]  # rid, tokens shared with base
    reqs = [submit(sched, rid, base[:n] + prompt(200 + i, 10)) for i, (rid, n) in enumerate(spec)]
    outs = drain(sched)
    assert log.rids(0) == ["b", "d", "e", "a", "c"]  # longest match first, ties by arrival
    assert {r.rid: r.cached_tokens for r in reqs} == dict(spec)
    assert_exact(outs, reqs)


@pytest.mark.parametrize(("threshold", "expect"), [(2, ["x", "y", "z"]), (3, ["z", "x", "y"]), (0, ["z", "x", "y"])])
def test_lpm_falls_back_to_fcfs_past_the_threshold(threshold: int, expect: list[str]) -> None:
    sched, _, _ = make_scheduler(pool_tokens=512, schedule_policy="lpm", lpm_fallback_threshold=threshold)
    base = prompt(1, 20)
    _warm(sched, base)
    log = BatchLog(sched)
    reqs = [submit(sched, "x", prompt(2, 10)), submit(sched, "y", prompt(3, 10)),
            submit(sched, "z", base + [7])]
    outs = drain(sched)
    assert log.rids(0) == expect  # 3 waiting: > 2 falls back; 3 and 0 (never) keep lpm
    assert_exact(outs, reqs)


@pytest.mark.parametrize("dedup", [True, False])
def test_lpm_in_batch_prefix_caching_makes_a_sharer_wait(dedup: bool) -> None:
    """r1 and r2 share a 40-token prefix nobody has cached; with the check on, r2 goes behind r3
    and, the batch being full (prefill_max_requests=2), runs next round as a 40-token cache hit."""
    sched, _, _ = make_scheduler(
        pool_tokens=512, schedule_policy="lpm", prefill_max_requests=2,
        in_batch_prefix_caching_deprioritize_threshold=32 if dedup else 0,
    )
    log = BatchLog(sched)
    shared = prompt(5, 40)
    r1 = submit(sched, "r1", shared + prompt(6, 10))
    r2 = submit(sched, "r2", shared + prompt(7, 10))
    r3 = submit(sched, "r3", prompt(8, 50))
    outs = drain(sched)
    if dedup:
        assert log.rids(0) == ["r1", "r3"] and log.rids(1)[-1] == "r2"
        assert r2.cached_tokens == 40
    else:
        assert log.rids(0) == ["r1", "r2"]
        assert r2.cached_tokens == 0
    assert_exact(outs, [r1, r2, r3])


def _req(rid: str, ids: list[int]) -> Req:
    return Req(rid, ids, SamplingParams(max_new_tokens=1))


def test_in_batch_thresholds() -> None:
    shared = list(range(1, 41))
    a, b, c = _req("a", shared + [50, 51]), _req("b", shared + [60, 61]), _req("c", shared[:20] + [70] * 20)
    assert in_batch_deprioritized([a, b, c], [0, 0, 0], 32, 32) == {1}  # c shares 20 < 32 only
    assert in_batch_deprioritized([a, b, c], [0, 0, 0], 32, 16) == {1, 2}  # 20 >= 16
    assert in_batch_deprioritized([a, b, c], [0, 33, 0], 32, 32) == set()  # b is cached past the check
    assert in_batch_deprioritized([a, b, c], [0, 0, 0], 32, 0) == set()  # 0 disables


@pytest.mark.parametrize("page_size", [1, 4])
def test_lpm_incremental_matches_track_inserts_evictions_splits_and_resets(page_size: int) -> None:
    """The cached lengths always equal a fresh match_prefix, across random tree changes."""
    rng = random.Random(page_size)
    alloc = TokenToKVPoolAllocator(4096, page_size)
    tree = RadixCache(ReqToTokenPool(1, 8), alloc)
    cache = PrefixLengthCache()

    def seq(n: int) -> list[int]:
        return [rng.randrange(1, 4) for _ in range(n)]  # tiny alphabet: lots of sharing

    def insert(ids: list[int]) -> None:
        ids = ids[: len(ids) - len(ids) % page_size]
        if not ids or alloc.available_size() < len(ids):
            return
        vals = alloc.alloc(len(ids))
        dup = tree.insert(RadixKey(ids), vals)
        alloc.free(vals[:dup])

    reqs = [_req(f"r{i}", seq(rng.randrange(2, 40))) for i in range(40)]
    for step in range(300):
        op = rng.random()
        if op < 0.45:
            insert(seq(rng.randrange(1, 40)) if rng.random() < 0.5 else rng.choice(reqs).origin_input_ids)
        elif op < 0.65:
            tree.evict(rng.randrange(1, 60))
        elif op < 0.85:
            tree.match_prefix(RadixKey(seq(rng.randrange(1, 30))))  # splits
        elif op < 0.9:
            r = rng.choice(reqs)  # a request retracted after decoding: its key grew
            r.output_ids.append(rng.randrange(1, 4))
            r.reset_for_retract()
        elif op < 0.92:
            tree.evict(tree.evictable_size())
            tree.reset()
        want = [len(tree.match_prefix(RadixKey(r.fill_ids[:-1])).device_indices) for r in reqs]
        assert cache.prefix_lens(reqs, tree) == want, step
    tree.check_integrity()


def test_policy_bench_runs_small() -> None:
    r = bench_lpm_order(num_seqs=40, seq_len=60, num_waiting=300, repeats=2)  # asserts agreement itself
    assert set(r) >= {"cold_ms", "warm_ms", "churn_ms", "naive_ms"}


# --- dfs-weight (seed 000, section 4.2.2.1) ----------------------------------------------------


def test_dfs_weight_reproduces_the_seed_example() -> None:
    """Seed 000's tree: root -> A -> {C, D}, root -> B -> E -> {F, G}; 4 requests end at C, 2 at D,
    2 at F, 2 at G. Weights: C 4, D 2, A 6, F 2, G 2, E 4, B 4, root 10. Order: A's branch (6)
    before B's (4); C (4) before D (2); then F, G (equal: the tree's order)."""
    sched, _, _ = make_scheduler(pool_tokens=512, schedule_policy="dfs-weight")
    A, C, D, B, E, F, G = [1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12], [13, 14]
    _warm(sched, A + C, A + D, B + E + F, B + E + G)
    sched.kv.tree_cache.match_prefix(RadixKey(B))  # split B|E, as drawn in the seed
    shape = {tuple(c.key): sorted(tuple(g.key) for g in c.children.values())
             for c in sched.kv.tree_cache.root.children.values()}
    assert shape == {(1, 2): [(3, 4), (5, 6)], (7, 8): [(9, 10)]}

    log = BatchLog(sched)
    path = {"c": A + C, "d": A + D, "f": B + E + F, "g": B + E + G}
    arrival = ["g1", "f1", "d1", "c1", "g2", "c2", "f2", "d2", "c3", "c4"]  # scrambled on purpose
    reqs = [submit(sched, rid, path[rid[0]] + [100 + i, 200 + i]) for i, rid in enumerate(arrival)]
    outs = drain(sched)
    assert log.rids(0) == ["c1", "c2", "c3", "c4", "d1", "d2", "f1", "f2", "g1", "g2"]
    assert all(r.cached_tokens == len(path[r.rid[0]]) for r in reqs)
    assert_exact(outs, reqs)


def test_dfs_weight_order_directly_and_with_priority() -> None:
    sched, _, _ = make_scheduler(pool_tokens=512)
    _warm(sched, [1, 2, 3, 4], [1, 2, 5, 6], [7, 8, 9])
    waiting = [_req("x", [7, 8, 9, 1, 1]), _req("y", [1, 2, 3, 4, 1, 1]), _req("z", [1, 2, 5, 6, 2, 2]),
               _req("w", [50, 51])]
    pol = get_policy("dfs-weight")
    ctx = PolicyContext(prefix_tree=sched.kv.prefix_tree, now=0.0)
    assert [r.rid for r in pol.order(waiting, ctx)] == ["y", "z", "x", "w"]  # [1,2] branch weighs 2
    waiting[2].priority = 5
    ctx = PolicyContext(prefix_tree=sched.kv.prefix_tree, now=0.0, prio=PrioritySettings(enabled=True, default=0))
    assert [r.rid for r in pol.order(waiting, ctx)] == ["z", "y", "x", "w"]


# --- outputs never depend on the policy ---------------------------------------------------------


SETTINGS = [{"schedule_policy": p} for p in SCHEDULE_POLICIES] + [
    {"schedule_policy": "lpm", "lpm_fallback_threshold": 0},
    {"schedule_policy": "fcfs", "enable_priority_scheduling": True, "priority_scheduling_preemption_threshold": 0},
    {"schedule_policy": "lpm", "enable_priority_scheduling": True, "schedule_low_priority_values_first": True},
    {"scheduler": "unified", "max_num_batched_tokens": 48},
    {"scheduler": "unified", "scheduling_policy": "priority", "long_prefill_token_threshold": 16},
    {"schedule_policy": "lpm", "page_size": 4},
    {"schedule_policy": "dfs-weight", "radix": False},
    {"scheduler": "unified", "page_size": 4, "max_num_batched_tokens": 30},
    {"scheduler": "unified", "radix": False},
]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_outputs_equal_expected_tokens_under_every_policy(settings: dict) -> None:
    stats = _mixed_workload(settings)
    assert stats.num_retractions + stats.num_preemptions > 0  # the pool was tight enough to matter


def _mixed_workload(settings: dict):  # type: ignore[no-untyped-def]
    """Shared prefixes, chunked prompts, a tight pool (retraction / preemption) and late arrivals."""
    sched, _, _ = make_scheduler(pool_tokens=160, max_reqs=8, chunked_prefill_size=32, init_new_token_ratio=0.1,
                                 **settings)  # a low reserve: retractions happen
    rng = random.Random(3)
    system = prompt(9, 24)
    reqs, outs = [], []
    for i in range(14):
        p = (system if i % 3 else []) + prompt(50 + i, rng.randrange(4, 40))
        reqs.append(submit(sched, f"r{i}", p, max_new=rng.randrange(1, 24), priority=rng.randrange(0, 30)))
        if i % 4 == 3:
            for _ in range(3):
                outs += sched.step()
    outs += drain(sched)
    assert_exact(outs, reqs)
    return sched.stats
