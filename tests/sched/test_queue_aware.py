"""--radix-eviction-policy queue-aware keeps the prefix a waiting request needs (LRU evicts it)."""

from __future__ import annotations

import pytest

from radixserve.mem.evict_policy import QueueAwareStrategy
from tests.fakes import drain, expected_tokens, make_scheduler
from tests.sched.policy_helpers import prompt, submit


def _run(policy: str) -> int:
    sched, _, kv = make_scheduler(pool_tokens=100, prefill_max_requests=1, radix_eviction_policy=policy)
    if policy == "queue-aware":  # tests.fakes builds the RadixCache itself: give it the strategy
        kv.tree_cache.strategy = QueueAwareStrategy()  # type: ignore[attr-defined]
    p, q = prompt(1, 30), prompt(2, 30)
    submit(sched, "warm-p", p, 1)
    drain(sched)
    submit(sched, "warm-q", q, 1)  # q is the more recently used
    drain(sched)
    assert kv.tree_cache.evictable_size() == 60
    r = submit(sched, "r", prompt(3, 45), 1)  # first in line; needs 45 slots: 40 free, evict one leaf
    w = submit(sched, "w", p + prompt(4, 5), 1)  # waits a round; reuses p
    drain(sched)
    for x in (r, w):
        assert x.output_ids == expected_tokens(x.origin_input_ids, 1)
    return w.cached_tokens


def test_lru_evicts_the_waiting_prefix() -> None:
    assert _run("lru") == 0


def test_queue_aware_keeps_it() -> None:
    assert _run("queue-aware") == 30


def test_strategy_orders_unwanted_first() -> None:
    s = QueueAwareStrategy()

    class N:
        def __init__(self, id: int, t: int) -> None:
            self.id, self.last_access_time = id, t

    a, b = N(1, 1), N(2, 5)
    s.wanted = {1}
    assert sorted([a, b], key=s.priority) == [b, a]
    s.wanted = set()
    assert sorted([a, b], key=s.priority) == [a, b]


@pytest.mark.parametrize("policy", ["lru", "lfu", "queue-aware"])
def test_config_accepts(policy: str) -> None:
    make_scheduler(radix_eviction_policy=policy)
