"""Router policies: exact picks, the seed's thresholds at their boundaries, the affinity window."""

from __future__ import annotations

import random

import pytest

from radixserve.router.policy import (
    CacheAware,
    PolicyConfig,
    RouteRequest,
    Target,
    make_router_policy,
    router_policy_names,
)


def targets(*loads: int) -> list[Target]:
    out = [Target(f"http://w{i}") for i in range(len(loads))]
    for t, load in zip(out, loads, strict=True):
        t.load = load
    return out


def text(s: str) -> RouteRequest:
    return RouteRequest(text=s)


def test_registry_names_and_unknown() -> None:
    assert router_policy_names() == ["cache_aware", "deadline_aware", "power_of_two", "random", "round_robin"]
    with pytest.raises(ValueError, match="unknown router policy 'nope'"):
        make_router_policy("nope")


def test_round_robin_cycles_in_order() -> None:
    p = make_router_policy("round_robin")
    ts = targets(0, 0, 0)
    assert [p.select(ts, text("x")).target.url for _ in range(7)] == [
        "http://w0", "http://w1", "http://w2", "http://w0", "http://w1", "http://w2", "http://w0"]


def test_random_is_seeded_and_uniform_enough() -> None:
    ts = targets(0, 0, 0, 0)
    a = make_router_policy("random", PolicyConfig(seed=7))
    b = make_router_policy("random", PolicyConfig(seed=7))
    picks = [a.select(ts, text("x")).target.url for _ in range(400)]
    assert picks == [b.select(ts, text("x")).target.url for _ in range(400)]
    assert all(80 <= picks.count(f"http://w{i}") <= 120 for i in range(4))


def test_power_of_two_picks_the_less_loaded_of_the_two_drawn() -> None:
    ts = targets(5, 1, 9, 3)
    p = make_router_policy("power_of_two", PolicyConfig(seed=3))
    rng = random.Random(3)
    for _ in range(50):
        i, j = rng.sample(range(4), 2)
        want = ts[j] if ts[j].load < ts[i].load else ts[i]
        assert p.select(ts, text("x")).target is want


def test_power_of_two_uses_the_workers_reported_load_when_larger() -> None:
    ts = targets(0, 2)
    ts[0].reported_load = 10  # the worker says it runs more than the router sent it
    p = make_router_policy("power_of_two", PolicyConfig(seed=0))
    assert {p.select(ts, text("x")).target.url for _ in range(10)} == {"http://w1"}


def test_cache_aware_hit_goes_to_the_holder() -> None:
    p = make_router_policy("cache_aware")
    ts = targets(0, 0)
    first = p.select(ts, text("Alpha system prompt: question 1"))
    assert first.branch == "cache_miss" and first.target is ts[0]  # equal trees: the first listed
    second = p.select(ts, text("Beta system prompt: question 1"))
    assert second.branch == "cache_miss" and second.target is ts[1]  # w0's tree is bigger now
    again = p.select(ts, text("Alpha system prompt: question 2"))
    assert again.branch == "cache_hit" and again.target is ts[0]
    assert again.matched == len("Alpha system prompt: question ")


@pytest.mark.parametrize(("matched", "branch"), [(3, "cache_miss"), (4, "cache_hit")])
def test_cache_threshold_boundary(matched: int, branch: str) -> None:
    """match_rate must be strictly above 0.3: 3 of 10 is a miss, 4 of 10 a hit."""
    p = make_router_policy("cache_aware")
    ts = targets(0, 0)
    p.select(ts, text("abc" + "d" * (matched - 3) + "Z" * 20))  # w0 holds the first `matched` chars
    d = p.select(ts, text("abc" + "d" * (matched - 3) + "q" * (10 - matched)))
    assert d.branch == branch
    assert d.match_rate == pytest.approx(matched / 10)
    assert d.target is (ts[0] if branch == "cache_hit" else ts[1])  # a miss: w1 has the smaller tree


@pytest.mark.parametrize(("lo", "hi", "imbalanced"), [
    (0, 64, False),     # difference 64 is not > 64
    (0, 65, True),
    (100, 164, False),
    (100, 165, True),   # 65 > 64 and 165 > 150
    (200, 300, False),  # 100 > 64 but 300 is not > 300
    (200, 301, True),
])
def test_balance_thresholds_boundaries(lo: int, hi: int, imbalanced: bool) -> None:
    p = make_router_policy("cache_aware")
    ts = targets(hi, lo)
    p.select([ts[0]], text("shared prefix and more"))  # only w0 holds the key
    d = p.select(ts, text("shared prefix and more"))
    if imbalanced:
        assert d.branch == "balance" and d.target is ts[1]
    else:
        assert d.branch == "cache_hit" and d.target is ts[0]


def test_relative_threshold_is_configurable() -> None:
    p = make_router_policy("cache_aware", PolicyConfig(balance_abs_threshold=2, balance_rel_threshold=3.0))
    ts = targets(9, 3)
    p.select([ts[0]], text("k" * 10))
    assert p.select(ts, text("k" * 10)).branch == "cache_hit"  # 9 is not > 3 * 3
    ts[0].load = 10
    assert p.select(ts, text("k" * 10)).branch == "balance"


def test_hit_among_several_holders_takes_the_least_loaded() -> None:
    p = make_router_policy("cache_aware")
    ts = targets(3, 1, 0)
    p.select([ts[0]], text("common prefix xyz"))
    p.select([ts[1]], text("common prefix xyz"))
    d = p.select(ts, text("common prefix xyz!"))
    assert d.branch == "cache_hit" and d.target is ts[1]


def test_miss_picks_the_smallest_tree() -> None:
    p = make_router_policy("cache_aware")
    ts = targets(0, 0, 0)
    p.select([ts[0]], text("a" * 30))
    p.select([ts[1]], text("b" * 10))
    d = p.select(ts, text("c" * 5))
    assert d.branch == "cache_miss" and d.target is ts[2]


def test_balance_affinity_keeps_the_holder_within_the_window() -> None:
    system = "S" * 200
    for affinity, want_branch, want in ((False, "balance", 2), (True, "balance_affinity", 1)):
        p = make_router_policy("cache_aware", PolicyConfig(balance_affinity=affinity))
        ts = targets(200, 40, 0)  # w0 is far above the others; w1 is within 64 of the least loaded
        p.select([ts[0]], text(system + "q0"))
        p.select([ts[1]], text(system + "q1"))
        d = p.select(ts, text(system + "q2"))
        assert d.branch == want_branch and d.target is ts[want], affinity


def test_balance_affinity_without_any_match_is_least_loaded() -> None:
    p = make_router_policy("cache_aware", PolicyConfig(balance_affinity=True))
    ts = targets(200, 40, 0)
    d = p.select(ts, text("nothing cached"))
    assert d.branch == "balance" and d.target is ts[2]


def test_tokens_are_matched_as_tokens() -> None:
    p = make_router_policy("cache_aware")
    ts = targets(0, 0)
    p.select([ts[1]], RouteRequest(tokens=[1, 2, 3, 4, 5]))
    d = p.select(ts, RouteRequest(tokens=[1, 2, 3, 9]))
    assert d.branch == "cache_hit" and d.target is ts[1] and d.matched == 3


def test_remove_target_forgets_its_prefixes_and_eviction_bounds_the_tree() -> None:
    p = make_router_policy("cache_aware", PolicyConfig(max_tree_size=10))
    assert isinstance(p, CacheAware)
    ts = targets(0, 0)
    p.select([ts[0]], text("x" * 8))
    p.select([ts[0]], text("y" * 8))  # newer
    assert p.tree.tenant_size(ts[0].key) == 16
    assert p.evict() == 8
    assert p.tree.match("x" * 8)[0] == 0 and p.tree.match("y" * 8)[0] == 8  # LRU went first
    p.remove_target(ts[0].key)
    assert p.tree.match("y" * 8)[0] == 0
    p.tree.check_integrity()


def test_dp_targets_are_distinct_tenants() -> None:
    p = make_router_policy("cache_aware")
    ts = [Target("http://w0", 0), Target("http://w0", 1)]
    assert ts[0].key != ts[1].key
    p.select([ts[1]], text("rank one prefix"))
    assert p.select(ts, text("rank one prefix!")).target is ts[1]


def test_deadline_aware_routes_where_the_deadline_holds_or_refuses() -> None:
    from radixserve.router.policy import NoTargetMeetsDeadline

    p = make_router_policy("deadline_aware")
    ts = targets(0, 0, 0)
    for t, waiting in zip(ts, (9000, 1000, 3000), strict=True):
        t.prefill_tokens_per_s, t.waiting_tokens = 1000.0, waiting
    req = RouteRequest(tokens=list(range(1000)), deadline_ms=2500.0)
    # predicted: w0 10 s, w1 2 s, w2 4 s: only w1 meets 2.5 s
    d = p.select(ts, req)
    assert d.target is ts[1] and d.branch == "deadline_fastest"
    ts[1].sent_tokens = 1000  # what the router sent it since its report: now 3 s
    with pytest.raises(NoTargetMeetsDeadline, match="best predicted is 3000 ms"):
        p.select(ts, RouteRequest(tokens=list(range(5000, 6000)), deadline_ms=2500.0))
    # a cached prefix counts: w1 holds the first 1000 tokens, so only 200 new ones: 2.2 s
    hit = p.select(ts, RouteRequest(tokens=list(range(1200)), deadline_ms=2500.0))
    assert hit.target is ts[1] and hit.branch == "deadline_hit"
    # no deadline: cache_aware's rules
    assert p.select(ts, RouteRequest(tokens=list(range(1000)))).branch == "cache_hit"


def test_deadline_aware_trusts_a_target_without_a_report() -> None:
    p = make_router_policy("deadline_aware")
    ts = targets(0, 0)
    assert p.select(ts, RouteRequest(text="x" * 400, deadline_ms=1.0)).target is ts[0]


def test_miss_by_load_picks_the_least_loaded_not_the_smallest_tree() -> None:
    p = make_router_policy("cache_aware", PolicyConfig(miss_by_load=True))
    ts = targets(5, 0, 3)
    p.select([ts[1]], text("a" * 40))  # w1 holds the biggest tree but is the least loaded
    d = p.select(ts, text("z" * 10))
    assert d.branch == "cache_miss" and d.target is ts[1]


def test_consistent_misses_agree_across_replicas_and_spread_evenly() -> None:
    """Two replicas with the same cache events but their own in-flight counts: a miss goes where the
    prompt's hash says among the targets within the balance window, the same on both; a hit still
    goes to the holder; an imbalanced target takes no miss; over many prompts the misses spread."""
    cfg = PolicyConfig(consistent_misses=True, miss_by_load=True, balance_abs_threshold=4)
    a, b = make_router_policy("cache_aware", cfg), make_router_policy("cache_aware", cfg)
    ta, tb = targets(0, 3, 1, 2), targets(2, 0, 3, 1)
    for p, ts in ((a, ta), (b, tb)):
        assert isinstance(p, CacheAware)
        p.on_cache_stored(ts[2].key, [7] * 40)  # the same event reaches both
    rng = random.Random(0)
    prompts = [RouteRequest(tokens=[rng.randrange(1000) for _ in range(30)]) for _ in range(2000)]
    picks = [a.choose(ta, r).target.key for r in prompts]
    assert picks == [b.choose(tb, r).target.key for r in prompts]  # loads differ, decisions do not
    assert all(a.choose(ta, r).branch == "cache_miss" for r in prompts)
    assert max(picks.count(t.key) for t in ta) < 1.2 * min(picks.count(t.key) for t in ta)
    hit = a.choose(ta, RouteRequest(tokens=[7] * 40))
    assert hit.branch == "cache_hit" and hit.target is ta[2]
    heavy = targets(0, 1, 9, 1)  # w2 is past the window (9 - 0 > 4 and 9 > 0 * 1.5)
    assert all(a.choose(heavy, r).target is not heavy[2] for r in prompts)
    plain = make_router_policy("cache_aware", PolicyConfig(miss_by_load=True))
    assert [plain.choose(ta, r).target for r in prompts[:5]] == [ta[0]] * 5  # the least loaded, always


def test_a_prefix_in_a_workers_kv_tier_gets_partial_credit() -> None:
    """w0 holds 100 tokens of the prompt in its pool, w1 400 in its KV tier (cache events with a
    medium): at weight 0.5 w1's 200 beat w0's 100; at weight 0 the tier counts for nothing; a tier
    block the worker drops loses its credit."""
    key = list(range(500))
    for weight, winner in ((0.5, 1), (0.0, 0)):
        p = make_router_policy("cache_aware", PolicyConfig(miss_by_load=True, tier_weight=weight, cache_threshold=0.1))
        assert isinstance(p, CacheAware)
        ts = targets(0, 0)
        p.on_cache_stored(ts[0].key, key[:100])
        p.on_cache_stored(ts[1].key, key[:400], "DISK")
        d = p.choose(ts, RouteRequest(tokens=key))
        assert d.target is ts[winner] and d.branch == "cache_hit", (weight, d)
        assert d.matched == (200 if winner == 1 else 100)
    p.on_cache_removed(ts[1].key, key[:400], 0, "DISK")  # (weight 0.5 again below)
    p2 = make_router_policy("cache_aware", PolicyConfig(miss_by_load=True, tier_weight=0.5, cache_threshold=0.1))
    assert isinstance(p2, CacheAware)
    p2.on_cache_stored(ts[0].key, key[:100])
    p2.on_cache_stored(ts[1].key, key[:400], "DISK")
    p2.on_cache_removed(ts[1].key, key[:400], 64, "DISK")  # all but its first block
    assert p2.choose(ts, RouteRequest(tokens=key)).target is ts[0]  # w1: 32 < w0: 100
    p2.remove_target(ts[1].key)
    assert p2.lower.tenant_size(ts[1].key) == 0
