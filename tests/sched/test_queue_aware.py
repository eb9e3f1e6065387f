"""--radix-eviction-policy queue-aware keeps the prefix a waiting request needs (LRU evicts it), set
as a ServerArgs field and built the way the engine and the simulator build their scheduler."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from radixserve.config import ServerArgs
from radixserve.mem.evict_policy import LFUStrategy, LRUStrategy, QueueAwareStrategy
from radixserve.mem.kv_format import kv_format
from radixserve.mem.radix_cache import RadixCache
from radixserve.sched.core import SchedulerCore
from radixserve.sched.req import Req
from radixserve.sim.simulator import SimRunner
from tests.fakes import VOCAB, EchoRunner, drain, expected_tokens, make_scheduler
from tests.sched.policy_helpers import prompt, submit

CTX = 512


class StubModelRunner(EchoRunner):
    """What ``serving_build.build_scheduler`` needs of a ``ModelRunner``, with EchoRunner's tokens."""

    class _Tok:
        def decode(self, ids: list[int], skip_special: bool = True) -> str:
            return " ".join(map(str, ids))

    class _Cfg:
        vocab_size = VOCAB
        whole_window = None  # no sliding window
        sliding_layers = ()  # nor sliding layers

    tokenizer = _Tok()
    stop_token_ids = (0,)
    model_config = _Cfg()
    draft = None

    def use_kv_cache_dtype(self, name: str) -> None:
        self.kv_format = kv_format(name, torch.float32)

    def use_draft(self, args: object) -> None:  # no draft model here
        return None

    def kv_bytes_per_token(self) -> int:
        return 64

    def make_kv_pool(self, size: int, page_size: int = 1) -> None:
        return None

    def attach_pools(self, kv_pool: Any, req_to_token_pool: Any) -> None:
        self.pool = req_to_token_pool


def _args(policy: str) -> ServerArgs:
    return ServerArgs(max_total_tokens=100, max_running_requests=16, prefill_max_requests=1,
                      radix_eviction_policy=policy)


def build_fakes(policy: str) -> SchedulerCore:
    return make_scheduler(pool_tokens=100, prefill_max_requests=1, radix_eviction_policy=policy)[0]


def build_engine(policy: str) -> SchedulerCore:
    from radixserve.serving_build import build_scheduler  # the engine's own construction path

    return build_scheduler(_args(policy), StubModelRunner(), CTX)  # type: ignore[arg-type]


def build_sim(policy: str) -> SchedulerCore:
    from radixserve.sim.cost_model import make_cost_model
    from radixserve.sim.simulator import build_sim_scheduler

    return build_sim_scheduler(_args(policy), make_cost_model("linear"), CTX)[0]


BUILDERS: dict[str, Callable[[str], SchedulerCore]] = {"fakes": build_fakes, "engine": build_engine, "sim": build_sim}


def _submit(sched: SchedulerCore, rid: str, ids: list[int]) -> Req:
    runner = sched.runner
    if isinstance(runner, SimRunner):  # the simulated model must know what the request will produce
        runner.expected[rid] = (1, 0, 0)
    return submit(sched, rid, ids, 1)


def _run(sched: SchedulerCore) -> int:
    kv = sched.kv
    p, q = prompt(1, 30), prompt(2, 30)
    _submit(sched, "warm-p", p)
    drain(sched)
    _submit(sched, "warm-q", q)  # q is the more recently used
    drain(sched)
    assert kv.tree_cache.evictable_size() == 60 and kv.available_size() == 40
    r = _submit(sched, "r", prompt(3, 45))  # first in line; needs 45 slots: 40 free, evict one leaf
    w = _submit(sched, "w", p + prompt(4, 5))  # waits a round; reuses p
    drain(sched)
    assert r.finished() and w.finished() and sched.stats.num_finished == 4
    if isinstance(sched.runner, EchoRunner):  # (the simulator's runner samples its own tokens)
        for x in (r, w):
            assert x.output_ids == expected_tokens(x.origin_input_ids, 1)
    return w.cached_tokens


@pytest.mark.parametrize("path", sorted(BUILDERS))
@pytest.mark.parametrize("policy, strategy, cached", [
    ("lru", LRUStrategy, 0),  # p is the least recently used leaf: evicted for r
    ("queue-aware", QueueAwareStrategy, 30),  # p is wanted by w: q goes instead
])
def test_eviction_policy_from_server_args(path: str, policy: str, strategy: type, cached: int) -> None:
    sched = BUILDERS[path](policy)
    assert isinstance(sched.kv.tree_cache, RadixCache) and type(sched.kv.tree_cache.strategy) is strategy
    assert _run(sched) == cached


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


@pytest.mark.parametrize("policy, strategy", [("lru", LRUStrategy), ("lfu", LFUStrategy),
                                              ("queue-aware", QueueAwareStrategy)])
def test_config_accepts(policy: str, strategy: type) -> None:
    sched = make_scheduler(radix_eviction_policy=policy)[0]
    assert type(sched.kv.tree_cache.strategy) is strategy  # type: ignore[attr-defined]
