"""The overlap loop (``SchedulerCore.step_overlapped``) gives the normal loop's outputs, token for
token, and leaks nothing: stop tokens, max_new_tokens, chunked prefill, retraction, priority
preemption, aborts, late arrivals, the unified scheduler and a failing forward.

Both loops are driven by the same script of events keyed to what the client has seen (a request's
n-th token, a finish), not to step numbers: the overlap loop reports every step one step late."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from radixserve.mem.kv_pool import ReqToTokenPool
from radixserve.sched.core import SchedulerCore
from radixserve.sched.finish import FINISH_ABORT
from radixserve.sched.io import OutRow
from radixserve.sched.req import Req
from radixserve.sched.sampling_params import SamplingParams
from tests.fakes import EchoRunner, expected_tokens, make_scheduler
from tests.sched.sched_helpers import prompt

Event = tuple[str, int, Callable[[SchedulerCore], None]]  # (rid, tokens seen, action); -1: at its finish


def _req(rid: str, p: list[int], max_new: int, **kw: Any) -> Req:
    eos = kw.pop("eos", ())
    priority = kw.pop("priority", None)
    return Req(rid, p, SamplingParams(max_new_tokens=max_new, **kw), eos_token_ids=eos, priority=priority,
               arrival_time=float(len(rid)))


def _run(sched: SchedulerCore, first: list[Req], events: list[Event], overlap: bool) -> dict[str, Any]:
    for r in first:
        sched.add_request(r)
    seen: dict[str, list[int]] = {}
    final: dict[str, Any] = {}
    pending = list(events)
    for _ in range(5000):
        outs = sched.step_overlapped() if overlap else sched.step()
        for o in outs:
            seen.setdefault(o.rid, []).extend(o.new_token_ids)
            if o.finished_reason is not None:
                assert o.rid not in final, f"{o.rid} finished twice"
                final[o.rid] = o.finished_reason
        for ev in list(pending):
            rid, n, action = ev
            if (n < 0 and rid in final) or (n >= 0 and len(seen.get(rid, [])) >= n):
                pending.remove(ev)
                action(sched)
        if not sched.has_work() and not pending:
            sched.step_overlapped() if overlap else sched.step()  # the idle step's self-check
            assert sched.forward.in_flight is None and not sched.forward.held
            sched.kv.check_invariant()
            return {"tokens": seen, "final": final}
    raise AssertionError("did not drain")


def _both(build: Callable[[], SchedulerCore], first: Callable[[], list[Req]], events: Callable[[], list[Event]]) -> dict:
    normal = _run(build(), first(), events(), overlap=False)
    over = _run(build(), first(), events(), overlap=True)
    assert over == normal
    return normal


def test_plain_decode_stop_tokens_and_lengths() -> None:
    p = [prompt(i, 8 + 3 * i) for i in range(6)]
    stop = expected_tokens(p[1], 9)[4]

    def first() -> list[Req]:
        return [_req("a", p[0], 12), _req("b", p[1], 9, eos=(stop,)), _req("c", p[2], 1),
                _req("d", p[3], 7, stop_token_ids=[expected_tokens(p[3], 7)[2]]), _req("e", p[4], 20),
                _req("f", p[5], 5, ignore_eos=True, eos=(expected_tokens(p[5], 5)[0],))]

    res = _both(lambda: make_scheduler(pool_tokens=512)[0], first, list)
    assert res["tokens"]["b"] == expected_tokens(p[1], 9)[:5]  # stopped at its EOS, nothing more
    assert res["tokens"]["a"] == expected_tokens(p[0], 12) and len(res["tokens"]["d"]) == 3


def test_overlap_schedules_ahead_and_drops_the_extra_token() -> None:
    """A decode step is scheduled before the previous one's results: a request that the previous
    step finishes runs once more, and that token is dropped."""
    sched, runner, _ = make_scheduler(pool_tokens=512)
    p = prompt(7, 10)
    sched.add_request(_req("x", p, 3))
    outs: list[OutRow] = []
    while sched.has_work():
        outs.extend(sched.step_overlapped())
    assert len(runner.batches) == 4  # prefill, 2 decodes, and a decode whose token is dropped
    assert [t for o in outs for t in o.new_token_ids] == expected_tokens(p, 3)
    sched.step_overlapped()
    sched.kv.check_invariant()


def test_late_arrivals_and_chunked_prefill() -> None:
    p = [prompt(20 + i, 40 + 11 * i) for i in range(5)]

    def events() -> list[Event]:
        return [("a", 2, lambda s: s.add_request(_req("late1", p[3], 6))),
                ("b", -1, lambda s: s.add_request(_req("late2", p[4], 4))),
                ("late1", 1, lambda s: s.add_request(_req("late3", p[0][:20] + p[4][:7], 5)))]

    def first() -> list[Req]:
        return [_req("a", p[0], 9), _req("b", p[1], 3), _req("c", p[2], 6)]

    _both(lambda: make_scheduler(pool_tokens=1024, chunked_prefill_size=16)[0], first, events)


def test_retraction() -> None:
    p = [prompt(40 + i, 20) for i in range(6)]

    def first() -> list[Req]:
        return [_req(f"r{i}", p[i], 40) for i in range(6)]

    build = lambda: make_scheduler(pool_tokens=160, max_reqs=8, init_new_token_ratio=0.05)[0]  # noqa: E731
    res = _both(build, first, list)
    assert all(res["tokens"][f"r{i}"] == expected_tokens(p[i], 40) for i in range(6))
    sched = build()
    _run(sched, first(), [], overlap=True)
    assert sched.stats.num_retractions > 0  # the scenario does retract


def test_priority_preemption() -> None:
    p = [prompt(60 + i, 30) for i in range(4)]

    def first() -> list[Req]:
        return [_req("low1", p[0], 20, priority=0), _req("low2", p[1], 20, priority=0)]

    def events() -> list[Event]:
        return [("low1", 3, lambda s: s.add_request(_req("high", p[2], 6, priority=10)))]

    build = lambda: make_scheduler(pool_tokens=512, max_reqs=2, max_running_requests=2,  # noqa: E731
                                   enable_priority_scheduling=True)[0]
    res = _both(build, first, events)
    assert res["tokens"]["high"] == expected_tokens(p[2], 6)


def test_aborts_while_running_and_waiting() -> None:
    p = [prompt(80 + i, 12) for i in range(4)]

    def first() -> list[Req]:
        return [_req("a", p[0], 30), _req("b", p[1], 30), _req("c", p[2], 30)]

    def events() -> list[Event]:
        return [("a", 4, lambda s: s.abort_request("b")), ("a", 6, lambda s: s.abort_request("a")),
                ("c", 2, lambda s: s.add_request(_req("d", p[3], 5)))]

    res = _both(lambda: make_scheduler(pool_tokens=512)[0], first, events)
    assert isinstance(res["final"]["a"], FINISH_ABORT) and len(res["tokens"]["a"]) == 6
    assert len(res["tokens"]["b"]) == 4


def test_unified_scheduler() -> None:
    p = [prompt(100 + i, 25 + 9 * i) for i in range(5)]

    def first() -> list[Req]:
        return [_req(f"u{i}", p[i], 10 + i) for i in range(5)]

    _both(lambda: make_scheduler(pool_tokens=600, scheduler="unified", max_num_batched_tokens=32)[0], first, list)


class _FailOnce(EchoRunner):
    """Fails the n-th forward."""

    def __init__(self, n: int, pool: ReqToTokenPool) -> None:
        super().__init__(pool)
        self.n = n

    def forward(self, batch):  # type: ignore[no-untyped-def]
        self.n -= 1
        if self.n == 0:
            raise RuntimeError("injected")
        return super().forward(batch)


def test_failed_forward_aborts_its_requests_and_the_step_built_on_it() -> None:
    # prefill, decode, decode, then the failing decode
    sched, _, kv = make_scheduler(pool_tokens=512, runner=lambda pool: _FailOnce(4, pool))
    p = prompt(3, 9)
    first = [_req("a", p, 20), _req("b", prompt(4, 9), 20)]
    res = _run(sched, first, [("a", -1, lambda s: s.add_request(_req("c", p, 4)))], overlap=True)
    assert isinstance(res["final"]["a"], FINISH_ABORT) and res["final"]["a"].code == "internal_error"
    assert res["tokens"]["c"] == expected_tokens(p, 4)  # the engine kept serving


def test_full_request_pool() -> None:
    """With every request slot taken, a request that ended keeps its slot until the step in flight
    that still reads its row is done: a newcomer waits for it instead of finding no slot."""
    p = [prompt(120 + i, 10) for i in range(6)]

    def first() -> list[Req]:
        return [_req(f"s{i}", p[i], 2 + i % 3) for i in range(6)]

    _both(lambda: make_scheduler(pool_tokens=512, max_reqs=2, max_running_requests=2)[0], first, list)


def test_mixed_chunk_built_ahead() -> None:
    """A MIXED step scheduled while a decode step runs: its decode rows wait for that step's tokens."""
    p = [prompt(140 + i, 20 + 37 * i) for i in range(4)]

    def first() -> list[Req]:
        return [_req("m0", p[0], 12), _req("m1", p[1], 9)]

    def events() -> list[Event]:
        return [("m0", 3, lambda s: s.add_request(_req("m2", p[2], 4))),
                ("m1", 5, lambda s: s.add_request(_req("m3", p[3], 6)))]

    build = lambda: make_scheduler(pool_tokens=1024, chunked_prefill_size=24, enable_mixed_chunk=True)[0]  # noqa: E731
    _both(build, first, events)
    sched = build()
    _run(sched, first(), events(), overlap=True)
    assert any(e[0] == "MIXED" for e in sched.stats.step_log)


@pytest.mark.parametrize("policy", ["fcfs", "lpm", "dfs-weight", "lof", "random", "sjf", "edf", "vtc"])
def test_every_policy_gives_the_same_outputs_under_both_loops(policy: str) -> None:
    shared = prompt(160, 24)
    p = [shared + prompt(170 + i, 5 + 3 * i) for i in range(5)] + [prompt(180 + i, 14) for i in range(3)]

    def first() -> list[Req]:
        return [_req(f"p{i}", ids, 6 + i % 4) for i, ids in enumerate(p[:5])]

    def events() -> list[Event]:
        return [("p0", 2, lambda s: [s.add_request(_req(f"q{i}", ids, 5)) for i, ids in enumerate(p[5:])])]

    res = _both(lambda: make_scheduler(pool_tokens=512, schedule_policy=policy, max_running_requests=4)[0],
                first, events)
    assert res["tokens"]["p4"] == expected_tokens(p[4], 6)
