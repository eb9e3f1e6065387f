"""vtc: tenant shares under a 10:1 request-rate skew (sched/fairness.py)."""

from __future__ import annotations

import pytest

from radixserve.sched.core import SchedulerCore
from radixserve.sched.policies.vtc import VirtualTokenCounter
from radixserve.sched.req import Req
from radixserve.sched.sampling_params import SamplingParams
from tests.fakes import drain, expected_tokens, make_scheduler
from tests.sched.policy_helpers import prompt


def add(sched: SchedulerCore, rid: str, tenant: str, n: int, max_new: int, arrival: float) -> Req:
    req = Req(rid, prompt(hash(rid) % 100000, n), SamplingParams(max_new_tokens=max_new), arrival_time=arrival)
    req.tenant = tenant
    sched.add_request(req)
    return req


def _served(reqs: list[Req]) -> float:
    """Weighted service so far: input tokens (w_p 1) of admitted requests + output tokens (w_q 2)."""
    return sum(r.prompt_len + 2 * len(r.output_ids) for r in reqs if r.admitted_before)


def _skewed(policy: str, weights: str | None) -> tuple[float, float]:
    """Tenant a sends 10x the requests of b (b's are twice as big); run while both are backlogged."""
    sched, _, _ = make_scheduler(pool_tokens=2048, max_reqs=8, max_running_requests=4, schedule_policy=policy,
                                 tenant_weights=weights)
    a = [add(sched, f"a{i}", "a", 16, 8, i * 0.1) for i in range(600)]
    b = [add(sched, f"b{i}", "b", 32, 16, i * 1.0) for i in range(60)]
    while any(r in sched.queues.waiting for r in b) and any(r in sched.queues.waiting for r in a):
        sched.step()
    sa, sb = _served(a), _served(b)
    drain(sched)
    for r in a[:3] + b[:3]:
        assert r.output_ids == expected_tokens(r.origin_input_ids, r.max_new_tokens)
    return sa / (sa + sb), sb / (sa + sb)


def test_equal_weights_give_equal_shares() -> None:
    share_a, share_b = _skewed("vtc", None)
    assert share_b == pytest.approx(0.5, abs=0.03)


def test_weights_two_to_one() -> None:
    share_a, share_b = _skewed("vtc", "a=2,b=1")
    assert share_a == pytest.approx(2 / 3, abs=0.03)


def test_fcfs_follows_the_skew() -> None:
    share_a, share_b = _skewed("fcfs", None)
    assert share_b < 0.25


def test_newly_backlogged_tenant_is_lifted() -> None:
    sched, _, _ = make_scheduler(schedule_policy="vtc")
    policy = sched.settings.policy
    assert isinstance(policy, VirtualTokenCounter)
    policy.counters.update({"a": 100.0, "b": 300.0, "c": 0.0})
    policy.backlogged = {"a", "b"}
    reqs = [add(sched, "ra", "a", 4, 1, 0.0), add(sched, "rb", "b", 4, 1, 0.0), add(sched, "rc", "c", 4, 1, 0.0)]
    order = policy.order(sched.queues.waiting, sched.parts.ordering.context(sched.clock()))
    assert policy.counters["c"] == 100.0  # lifted to the smallest backlogged counter: no banked credit
    assert [r.rid for r in order] == ["ra", "rc", "rb"]  # tie a/c: tenant name
    drain(sched)
    assert all(r.finished() for r in reqs)
