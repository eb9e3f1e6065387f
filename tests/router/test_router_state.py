"""The router's pure state: prefix tree, health, circuit breaker, admission queue."""

from __future__ import annotations

import asyncio
import random

import pytest

from radixserve.router.admission import Admission
from radixserve.router.tree import PrefixTree
from radixserve.router.worker import BreakerState, CircuitBreaker, Health


# --- prefix tree -------------------------------------------------------------------------------------
def test_tree_match_reports_each_tenants_depth() -> None:
    t = PrefixTree()
    t.insert("hello world", "a")
    t.insert("hello there", "b")
    assert t.match("hello wor") == (9, {"a": 9, "b": 6})
    assert t.match("help") == (3, {"a": 3, "b": 3})  # a partly matched node counts its matching part
    assert t.match("xyz") == (0, {})
    assert t.tenant_size("a") == 11 and t.tenant_size("b") == 11
    t.check_integrity()


def test_tree_remove_past_keep_splits_and_prunes() -> None:
    t = PrefixTree()
    t.insert("abcdefgh", "a")
    t.insert("abcdefgh", "b")
    assert t.remove("abcdefgh", "a", keep=3) == 5
    assert t.match("abcdefgh") == (8, {"a": 3, "b": 8})
    assert t.tenant_size("a") == 3
    assert t.remove("abcdefgh", "a", keep=0) == 3
    assert t.match("abc")[1] == {"b": 3}
    assert t.remove("zzz", "b") == 0 and t.remove("abq", "b", keep=3) == 0  # paths it does not hold
    t.check_integrity()


def test_tree_lru_eviction_per_tenant() -> None:
    t = PrefixTree()
    t.insert("aaaa", "x")       # oldest
    t.insert("bbbb", "x")
    t.insert("cccc", "y")
    t.insert("aaaa", "x")       # refreshed: bbbb is now the least recently used
    assert t.evict(max_size=4) == 4
    assert t.match("bbbb")[0] == 0 and t.match("aaaa")[1] == {"x": 4} and t.tenant_size("y") == 4
    t.check_integrity()


def test_tree_eviction_walks_up_once_children_are_gone() -> None:
    t = PrefixTree()
    t.insert("prefix-one", "x")
    t.insert("prefix-two", "x")
    t.insert("zz", "x")
    assert t.tenant_size("x") == 7 + 3 + 3 + 2
    t.evict(max_size=2)  # both children, then their parent "prefix-", leave; "zz" is newest
    assert t.tenant_size("x") == 2 and t.match("zz")[0] == 2 and t.match("prefix-one")[0] == 0
    t.check_integrity()


def test_tree_random_operations_keep_the_invariants() -> None:
    rng = random.Random(0)
    t = PrefixTree()
    tenants = ["a", "b", "c"]
    for _ in range(2000):
        key = [rng.randrange(4) for _ in range(rng.randrange(1, 12))]
        op = rng.random()
        tenant = rng.choice(tenants)
        if op < 0.6:
            t.insert(key, tenant)
            assert t.match(key)[1][tenant] == len(key)
        elif op < 0.85:
            keep = rng.randrange(len(key) + 1)
            t.remove(key, tenant, keep)
            assert t.match(key)[1].get(tenant, 0) <= keep
        elif op < 0.95:
            t.evict(rng.randrange(5, 40))
        else:
            t.remove_tenant(tenant)
            assert t.tenant_size(tenant) == 0
        t.check_integrity()


# --- health and circuit breaker ---------------------------------------------------------------------
def test_health_thresholds() -> None:
    h = Health(failure_threshold=3, success_threshold=2)
    assert [h.record(False) for _ in range(3)] == [False, False, True] and not h.healthy
    assert h.record(True) is False and not h.healthy
    assert h.record(False) is False  # a failure resets the run of passes
    assert [h.record(True), h.record(True)] == [False, True] and h.healthy


def test_circuit_breaker_cycle() -> None:
    cb = CircuitBreaker(failure_threshold=2, success_threshold=2, timeout_s=10.0)
    cb.record_failure(0.0)
    cb.record_success()  # a success resets the count of failures
    cb.record_failure(1.0)
    assert cb.state is BreakerState.CLOSED and cb.allow(1.0)
    cb.record_failure(2.0)
    assert cb.state is BreakerState.OPEN and not cb.allow(11.9)
    assert cb.allow(12.0) and cb.state is BreakerState.HALF_OPEN
    cb.on_send()
    assert not cb.allow(12.1)  # one probe at a time
    cb.record_failure(12.5)
    assert cb.state is BreakerState.OPEN and not cb.allow(22.0) and cb.allow(22.5)
    cb.on_send()
    cb.record_success()
    assert cb.state is BreakerState.HALF_OPEN and cb.allow(22.6)
    cb.on_send()
    cb.record_success()
    assert cb.state is BreakerState.CLOSED


def test_circuit_breaker_threshold_zero_never_opens() -> None:
    cb = CircuitBreaker(failure_threshold=0)
    for i in range(100):
        cb.record_failure(float(i))
    assert cb.state is BreakerState.CLOSED


# --- admission ---------------------------------------------------------------------------------------
def test_admission_queue_fifo_full_and_timeout() -> None:
    async def scenario() -> None:
        adm = Admission(limit=1, queue_size=2, timeout_s=0.2)
        assert await adm.acquire()
        order: list[str] = []

        async def waiter(name: str) -> None:
            if await adm.acquire():
                order.append(name)

        w1 = asyncio.create_task(waiter("first"))
        await asyncio.sleep(0)
        w2 = asyncio.create_task(waiter("second"))
        await asyncio.sleep(0)
        assert adm.waiting == 2
        assert not await adm.acquire() and adm.rejected == 1  # the queue is full: 429
        adm.release()  # the slot goes to the oldest waiter
        await asyncio.sleep(0.01)
        assert order == ["first"] and adm.in_flight == 1
        await asyncio.gather(w1, w2)  # "second" times out
        assert order == ["first"] and adm.timed_out == 1 and adm.waiting == 0
        adm.release()
        assert adm.in_flight == 0

    asyncio.run(scenario())


def test_admission_cancelled_waiter_passes_its_slot_on() -> None:
    async def scenario() -> None:
        adm = Admission(limit=1, queue_size=5, timeout_s=5.0)
        assert await adm.acquire()
        gone = asyncio.create_task(adm.acquire())
        await asyncio.sleep(0)
        stays = asyncio.create_task(adm.acquire())
        await asyncio.sleep(0)
        gone.cancel()  # the client went away while queued
        with pytest.raises(asyncio.CancelledError):
            await gone
        adm.release()
        assert await asyncio.wait_for(stays, 1.0)
        adm.release()
        assert adm.in_flight == 0 and adm.waiting == 0

    asyncio.run(scenario())


def test_admission_unlimited() -> None:
    async def scenario() -> None:
        adm = Admission(limit=-1, queue_size=0, timeout_s=1.0)
        assert all([await adm.acquire() for _ in range(1000)])

    asyncio.run(scenario())


def test_admission_lets_waiters_through_by_priority_then_tenant_counter() -> None:
    from radixserve.router.admission import TenantCounters

    async def scenario() -> None:
        tenants = TenantCounters({"b": 2.0})
        adm = Admission(limit=1, queue_size=10, timeout_s=5.0, tenants=tenants)
        assert await adm.acquire(0, "a", 100.0)  # a holds the slot and was charged 100
        order: list[str] = []

        async def waiter(name: str, rank: int, tenant: str) -> None:
            assert await adm.acquire(rank, tenant, 100.0)
            order.append(name)

        tasks = []
        for name, rank, tenant in (("a-low", 5, "a"), ("b-low", 5, "b"), ("a-high", 1, "a"), ("c-low", 5, "c")):
            tasks.append(asyncio.create_task(waiter(name, rank, tenant)))
            await asyncio.sleep(0)
        # b and c arrived with no history: lifted to the smallest waiting counter (a's 100), so they
        # do not bring a backlog of credit
        assert tenants.get("b") == tenants.get("c") == 100.0
        for _ in range(4):
            adm.release()
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        # the high priority first (a: 200 now); then among rank 5: b and c (100) before a (200), b
        # first by arrival; b's charge counts half (weight 2)
        assert order == ["a-high", "b-low", "c-low", "a-low"]
        assert (tenants.get("a"), tenants.get("b"), tenants.get("c")) == (300.0, 150.0, 200.0)

    asyncio.run(scenario())
