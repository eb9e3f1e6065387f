"""Session affinity: the pure object (homes kept until overloaded or expired, consistent hashing
with bounded loads for new keys, the same choice on two routers), its composition with
cache_aware (the home wins ties and takes misses, balance first), and a router in front of stub
workers keeping each session on one worker."""

from __future__ import annotations

from collections import Counter

import aiohttp

from radixserve.router.affinity import SessionAffinity, routing_key
from radixserve.router.policy import CacheAware, RouteRequest, Target
from tests.router.router_helpers import Fleet, post, run


def _targets(n: int, dp: bool = False) -> list[Target]:
    return [Target("http://w0", dp_rank=i) if dp else Target(f"http://w{i}") for i in range(n)]


def test_a_home_holds_until_overloaded_gone_or_expired() -> None:
    ts = _targets(3)
    aff = SessionAffinity(ttl=100.0, balance_abs_threshold=4, balance_rel_threshold=1.5)
    first, why = aff.home("s1", ts, now=0.0)
    assert why == "affinity_new"
    aff.record("s1", first, 0.0)
    assert aff.home("s1", ts, 50.0) == (first, "affinity")
    first.load = 4  # within the balance thresholds of the idle ones (4 - 0 is not > 4): stays
    assert aff.home("s1", ts, 50.0) == (first, "affinity")
    first.load = 5  # over both thresholds: the key moves, to a target under the load bound
    moved, why = aff.home("s1", ts, 50.0)
    assert why == "affinity_moved" and moved is not first
    first.load = 0
    assert aff.home("s1", [t for t in ts if t is not first], 50.0)[1] == "affinity_moved"  # its home left
    assert aff.home("s1", ts, 151.0)[1] == "affinity_new"  # expired (100 s without a request)
    aff.record("s2", first, 200.0)
    assert "s1" not in aff.homes  # dropped on the way, as the oldest expired home


def test_new_homes_are_consistent_spread_and_bounded() -> None:
    ts = _targets(4)
    a, b = SessionAffinity(60, 64, 1.5), SessionAffinity(60, 64, 1.5)
    keys = [f"session-{i}" for i in range(400)]
    picks = [a.ring_choice(k, ts).key for k in keys]
    assert picks == [b.ring_choice(k, list(reversed(ts))).key for k in keys]  # another router, same homes
    spread = Counter(picks)
    assert len(spread) == 4 and min(spread.values()) > 40  # 400 keys over 4 targets, roughly even
    # a fifth target takes about a fifth of the keys and moves no key between the other four
    five = [*ts, Target("http://w4")]
    moved = [(p, a.ring_choice(k, five).key) for k, p in zip(keys, picks, strict=True)]
    assert all(new in (old, "http://w4") for old, new in moved)
    assert 40 < sum(new == "http://w4" for _, new in moved) < 140
    # bounded loads: a target at the bound is passed over for the next on the ring
    busy = a.ring_choice("session-7", ts)
    busy.load = 10  # the bound is ceil(1.25 * 11 / 4) = 4
    assert a.ring_choice("session-7", ts) is not busy
    # data-parallel ranks are targets like workers
    assert {a.ring_choice(k, _targets(2, dp=True)).key for k in keys} == {"http://w0#dp0", "http://w0#dp1"}


def test_the_routing_key_comes_from_the_first_header_then_the_user_field() -> None:
    names = ["x-session-id", "x-conversation"]
    assert routing_key({"x-conversation": "c", "x-session-id": "s"}, None, names, False) == "h:s"
    assert routing_key({"x-conversation": "c"}, {"user": "u"}, names, True) == "h:c"
    assert routing_key({}, {"user": "u"}, names, True) == "u:u"
    assert routing_key({}, {"user": "u"}, names, False) is None
    assert routing_key({}, {"user": ""}, [], True) is None


def test_cache_aware_prefers_the_home_for_ties_and_misses_but_balances_first() -> None:
    ts = _targets(3)
    p = CacheAware()
    p.tree.insert([1, 2, 3, 4], ts[0].key)
    p.tree.insert([1, 2, 3, 4], ts[1].key)
    assert p.select(ts, RouteRequest(tokens=[1, 2, 3, 4, 5], home=ts[1].key)).target is ts[1]  # a tie: the home
    assert p.select(ts, RouteRequest(tokens=[1, 2, 3, 4, 5], home=ts[2].key)).target in ts[:2]  # the prefix wins
    miss = p.select(ts, RouteRequest(tokens=[9, 9, 9], home=ts[2].key))
    assert (miss.target, miss.branch) == (ts[2], "affinity")
    ts[2].load = 100  # imbalanced: the least loaded, whatever the home
    assert p.select(ts, RouteRequest(tokens=[8, 8, 8], home=ts[2].key)).branch == "balance"


def test_a_router_keeps_each_session_on_one_worker() -> None:
    async def scenario(fleet: Fleet, client: aiohttp.ClientSession) -> None:
        urls = [await fleet.stub() for _ in range(3)]
        await fleet.start_router(urls, policy="round_robin", routing_key_headers="X-Session-Id",
                                 routing_key_user=True)
        seen: dict[str, set[int]] = {}
        for turn in range(4):
            for s in range(6):
                headers = {"x-session-id": f"s{s}"} if s < 4 else {}
                body = {"prompt": f"turn {turn}", "max_tokens": 1, **({"user": f"u{s}"} if s >= 4 else {})}
                status, out = await post(client, f"{fleet.url}/v1/completions", body, headers=headers)
                assert status == 200
                seen.setdefault(f"s{s}", set()).add(out["worker"])
        assert all(len(w) == 1 for w in seen.values()), seen  # one worker per session, header or user
        assert len({next(iter(w)) for w in seen.values()}) > 1  # sessions spread over the workers
        plain = set()
        for _ in range(3):  # no key: round robin as before
            plain.add((await post(client, f"{fleet.url}/v1/completions", {"prompt": "x", "max_tokens": 1}))[1]["worker"])
        assert len(plain) == 3

    run(scenario)
