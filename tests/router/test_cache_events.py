"""Cache events on the router's side: ``apply_batch`` on a ``CacheAware`` tree (exactly the evicted
part goes, a clear or a gap in ``seq`` drops the worker), and one subscriber following a real
``RadixCache`` over a ZeroMQ PUB socket."""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq

from radixserve.mem.cache_events import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    CacheEvent,
    EventBatch,
    EventBatcher,
    encode_batch,
)
from radixserve.mem.radix_cache import RadixCache, TreeNode
from radixserve.router.cache_events import CacheEventSubscriber, apply_batch
from radixserve.router.policy import CacheAware, RoundRobin
from radixserve.router.tree import PrefixTree, _Node
from radixserve.server.cache_events import CacheEventPublisher, advertised_endpoints, bind_endpoint
from tests.mem.radix_helpers import make, put


def batch(seq: int, *events: CacheEvent) -> EventBatch:
    return EventBatch(seq, 0.0, list(events))


def held(tree: PrefixTree, tenant: str) -> set[tuple[int, ...]]:
    """The maximal paths ``tenant`` is listed on in the router's tree."""
    out: set[tuple[int, ...]] = set()

    def walk(node: _Node, path: tuple[int, ...]) -> None:
        below = [c for c in node.children.values() if tenant in c.tenants]
        if not below and node is not tree.root:
            out.add(path)
        for c in below:
            walk(c, path + tuple(c.key))

    walk(tree.root, ())
    return out


def cached(cache: RadixCache) -> set[tuple[int, ...]]:
    """The root-to-leaf paths of a radix cache."""
    out: set[tuple[int, ...]] = set()

    def walk(node: TreeNode, path: tuple[int, ...]) -> None:
        if not node.children and node is not cache.root:
            out.add(path)
        for c in node.children.values():
            walk(c, path + tuple(c.key))

    walk(cache.root, ())
    return out


# --- apply_batch ---------------------------------------------------------------------------------


def test_stored_then_removed_loses_exactly_the_evicted_part() -> None:
    p = CacheAware()
    p.tree.insert([1, 2, 3, 4], "w1")  # another worker holding the same path is untouched
    assert apply_batch(p, "w0", batch(0, BlockStored([1, 2, 3, 4]), BlockStored([1, 2, 7, 8, 9])), None) == 0
    assert held(p.tree, "w0") == {(1, 2, 3, 4), (1, 2, 7, 8, 9)}
    assert p.tree.tenant_size("w0") == 7
    assert apply_batch(p, "w0", batch(1, BlockRemoved([1, 2, 3, 4], keep=2)), 0) == 1
    assert held(p.tree, "w0") == {(1, 2, 7, 8, 9)}
    assert p.tree.match([1, 2, 3, 4]) == (4, {"w1": 4, "w0": 2})
    assert p.tree.tenant_size("w0") == 5
    assert apply_batch(p, "w0", batch(2, BlockRemoved([1, 2, 7, 8, 9], 2), BlockRemoved([1, 2], 0)), 1) == 2
    assert held(p.tree, "w0") == set()
    assert p.tree.tenant_size("w0") == 0
    assert held(p.tree, "w1") == {(1, 2, 3, 4)}
    p.tree.check_integrity()


def test_removed_cuts_inside_a_router_node_and_below_it() -> None:
    p = CacheAware()
    p.tree.insert([1, 2, 3, 4, 5, 6], "w0")  # the router's own guess, longer than the worker's node
    apply_batch(p, "w0", batch(0, BlockRemoved([1, 2, 3, 4], keep=2)), None)
    assert held(p.tree, "w0") == {(1, 2)}
    p.tree.check_integrity()


def test_removed_of_a_path_the_router_lacks_is_a_no_op() -> None:
    p = CacheAware()
    apply_batch(p, "w0", batch(0, BlockStored([1, 2, 3])), None)
    apply_batch(p, "w0", batch(1, BlockRemoved([5, 6], 0), BlockRemoved([1, 2, 9], 2)), 0)
    assert held(p.tree, "w0") == {(1, 2, 3)}


def test_all_cleared_drops_the_target_only() -> None:
    p = CacheAware()
    p.tree.insert([1, 2], "w1")
    apply_batch(p, "w0", batch(0, BlockStored([1, 2, 3])), None)
    apply_batch(p, "w0", batch(1, AllCleared(), BlockStored([4, 5])), 0)
    assert held(p.tree, "w0") == {(4, 5)}
    assert held(p.tree, "w1") == {(1, 2)}
    p.tree.check_integrity()


@pytest.mark.parametrize("seq", [3, 0], ids=["lost-batch", "publisher-restart"])
def test_a_gap_in_seq_drops_the_target_before_applying(seq: int) -> None:
    p = CacheAware()
    p.tree.insert([9, 9], "w1")
    apply_batch(p, "w0", batch(0, BlockStored([1, 2, 3])), None)
    p.tree.insert([1, 2, 3, 4], "w0")  # the router's own guess goes too
    assert apply_batch(p, "w0", batch(1, BlockStored([5])), 0) == 1  # in order: kept
    assert held(p.tree, "w0") == {(1, 2, 3, 4), (5,)}
    assert apply_batch(p, "w0", batch(seq, BlockStored([6, 7])), 1) == seq
    assert held(p.tree, "w0") == {(6, 7)}
    assert held(p.tree, "w1") == {(9, 9)}


def test_the_first_batch_is_the_baseline() -> None:
    p = CacheAware()
    p.tree.insert([1, 2], "w0")
    assert apply_batch(p, "w0", batch(41, BlockStored([3])), None) == 41
    assert held(p.tree, "w0") == {(1, 2), (3,)}


def test_subscriber_counts_gaps_and_undecodable_messages() -> None:
    p = CacheAware()
    sub = CacheEventSubscriber("tcp://127.0.0.1:1", "w0", p)
    sub.on_message(b"\x01garbage")
    sub.on_message(encode_batch(batch(3, BlockStored([1]))))
    sub.on_message(encode_batch(batch(4, BlockStored([2]))))
    sub.on_message(encode_batch(batch(9, BlockStored([3]))))
    assert sub.stats() == {"endpoint": "tcp://127.0.0.1:1", "last_seq": 9, "batches": 3, "events": 3,
                           "gaps": 1, "errors": 1}
    assert held(p.tree, "w0") == {(3,)}


def test_subscriber_needs_a_cache_aware_policy() -> None:
    with pytest.raises(TypeError, match="round_robin"):
        CacheEventSubscriber("tcp://127.0.0.1:1", "w0", RoundRobin())


def test_radix_cache_events_rebuild_its_paths_in_the_router_tree() -> None:
    cache, alloc = make(size=24)
    batcher = EventBatcher()
    cache.event_sink = batcher.add
    p = CacheAware()
    last: int | None = None
    for tokens in ([1, 2, 3, 4], [1, 2, 7, 8, 9], [5, 6, 7], [1, 2, 3, 4, 10, 11], [12] * 8):
        put(cache, alloc, tokens)  # the pool fills: later puts evict earlier leaves first
        if alloc.available_size() < 8:
            cache.evict(8)
        b = batcher.take()
        assert b is not None
        last = apply_batch(p, "w0", b, last)
        assert held(p.tree, "w0") == cached(cache)
    p.tree.check_integrity()


# --- endpoints -----------------------------------------------------------------------------------


def test_endpoints_never_advertise_a_wildcard() -> None:
    assert bind_endpoint("127.0.0.1", 5557) == "tcp://127.0.0.1:5557"
    assert bind_endpoint("::1", 5557) == "tcp://[::1]:5557"
    assert advertised_endpoints("127.0.0.1", None) == []
    assert advertised_endpoints("10.1.2.3", 5557, dp_size=2) == ["tcp://10.1.2.3:5557", "tcp://10.1.2.3:5558"]
    for host in ("0.0.0.0", "::"):
        (ep,) = advertised_endpoints(host, 5557)
        assert "0.0.0.0" not in ep and "[::]" not in ep and ep.endswith(":5557")


# --- over ZeroMQ ---------------------------------------------------------------------------------


def test_subscriber_follows_a_radix_cache_over_zmq() -> None:
    async def main() -> None:
        ctx = zmq.Context()
        pub = CacheEventPublisher(ctx, "tcp://127.0.0.1:*")
        cache, alloc = make(size=16)
        cache.event_sink = pub.add
        policy = CacheAware()
        sub = CacheEventSubscriber(pub.endpoint, "w0", policy)
        sub.start()
        try:
            # PUB drops what it sends before the subscription reaches it: probe until one arrives
            deadline = time.monotonic() + 10
            while sub.batches == 0:
                assert time.monotonic() < deadline, "the subscriber never connected"
                pub.add(AllCleared())
                assert pub.flush()
                await asyncio.sleep(0.01)

            async def step() -> None:  # one scheduler step: its events go out as one batch
                assert pub.flush()
                want = pub.batcher.seq - 1
                while sub.last_seq != want:
                    assert time.monotonic() < deadline, f"batch {want} never arrived"
                    await asyncio.sleep(0.005)

            put(cache, alloc, [1, 2, 3, 4])
            put(cache, alloc, [1, 2, 7, 8, 9])
            put(cache, alloc, [5, 6, 7, 8])
            await step()
            assert held(policy.tree, "w0") == cached(cache) == {(1, 2, 3, 4), (1, 2, 7, 8, 9), (5, 6, 7, 8)}
            assert cache.evict(4) == 5  # LRU: [3,4], then [7,8,9]
            put(cache, alloc, [1, 2, 3, 4, 5, 6])
            await step()
            assert held(policy.tree, "w0") == cached(cache) == {(1, 2, 3, 4, 5, 6), (5, 6, 7, 8)}
            assert policy.tree.match([1, 2, 7, 8, 9]) == (2, {"w0": 2})
            assert sub.gaps == 0 and sub.errors == 0
            cache.check_integrity()
            policy.tree.check_integrity()
        finally:
            await sub.stop()
            pub.close()
            ctx.term()

    asyncio.run(main())


def test_server_args_validate_the_port() -> None:
    from radixserve.config import ServerArgs

    assert ServerArgs().cache_events_port is None
    assert ServerArgs(cache_events_port=5557, dp_size=2).cache_events_port == 5557
    for kwargs, msg in (({"cache_events_port": 0}, "cache_events_port must be in"),
                        ({"cache_events_port": 65535, "dp_size": 2}, "port \\+ N - 1"),
                        ({"cache_events_port": 29999, "dp_size": 2}, "collides with the HTTP port 30000"),
                        ({"cache_events_port": 5557, "disable_radix_cache": True}, "--disable-radix-cache")):
        with pytest.raises(ValueError, match=msg):
            ServerArgs(**kwargs)  # type: ignore[arg-type]
