"""Requests with a grammar: the grammar queue (compiled off the loop, aborts, failures, the queue cap)
and the scheduler's side of the sampler's contract (only rows that sample carry their matcher; a
grammar that ends finishes its request), under both event loops. The real grammars and masks are
tested in tests/model/test_grammar.py and end to end in tests/server/test_structured_output.py."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import pytest

from radixserve.mem.forward_batch import ForwardBatch, ForwardOutput
from radixserve.sched.core import SchedulerCore
from radixserve.sched.finish import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP
from radixserve.sched.req import Req
from radixserve.sched.sampling_params import SamplingParams
from tests.fakes import EchoRunner, expected_tokens, make_scheduler
from tests.sched.sched_helpers import finals, prompt, tokens

SCHEMA = '{"type": "object"}'


class CountingMatcher:
    """Stands for a grammar that is complete after ``n`` tokens."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.seen = 0

    def is_stopped(self) -> bool:
        return self.seen >= self.n


class GrammarEchoRunner(EchoRunner):
    """EchoRunner that does what the sampler does with matchers: each row that carries a live one
    feeds it the token, and reports the rows whose grammar ended (``ForwardOutput.grammar_ended``)."""

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        out = super().forward(batch)
        ended: dict[int, str] = {}
        for i, m in enumerate(batch.sampling.grammars or []):
            if m is not None and not m.is_stopped():
                m.seen += 1
                if m.is_stopped():
                    ended[i] = ""
        out.grammar_ended = ended or None
        return out


class FakeCompiler:
    def __init__(self) -> None:
        self.submitted: list[tuple[str, str]] = []
        self.futures: list[Future] = []
        self.ready: dict[tuple[str, str], Any] = {}

    def cached(self, kind: str, text: str) -> Any | None:
        m = self.ready.get((kind, text))
        return CountingMatcher(m.n) if m is not None else None

    def submit(self, kind: str, text: str) -> Future:
        f: Future = Future()
        self.submitted.append((kind, text))
        self.futures.append(f)
        return f


def _sched(**kw: Any) -> tuple[SchedulerCore, FakeCompiler]:
    sched, _, _ = make_scheduler(runner=GrammarEchoRunner, **kw)
    comp = FakeCompiler()
    sched.grammars.compiler = comp
    return sched, comp


def _req(rid: str, n: int = 6, max_new: int = 8, grammar: bool = True) -> Req:
    sp = SamplingParams(max_new_tokens=max_new, json_schema=SCHEMA if grammar else None)
    return Req(rid, prompt(len(rid) + n, n), sp)


def _drain(sched: SchedulerCore, overlap: bool, compile_after: int = -1, comp: FakeCompiler | None = None,
           n: int = 3) -> list:
    outs = []
    for step in range(2000):
        if step == compile_after and comp is not None:
            for f in comp.futures:
                f.set_result(CountingMatcher(n))
        outs.extend(sched.step_overlapped() if overlap else sched.step())
        if not sched.has_work():
            outs.extend(sched.step_overlapped() if overlap else sched.step())
            sched.kv.check_invariant()
            assert not sched.grammars.pending and not sched.queues.by_rid
            return outs
    raise AssertionError("did not drain")


@pytest.mark.parametrize("overlap", [False, True])
def test_waits_for_its_grammar_while_others_run(overlap: bool) -> None:
    sched, comp = _sched()
    g, plain = _req("g"), _req("plain", grammar=False)
    sched.add_request(g)
    sched.add_request(plain)
    assert comp.submitted == [("json_schema", SCHEMA)] and g not in sched.queues.waiting
    outs = _drain(sched, overlap, compile_after=4, comp=comp)
    got, fin = tokens(outs), finals(outs)
    assert got["plain"] == expected_tokens(plain.origin_input_ids, 8)
    assert fin["plain"].finished_reason == FINISH_LENGTH(8)
    # the grammar ended after 3 tokens: a stop, with exactly the tokens it was fed
    assert got["g"] == expected_tokens(g.origin_input_ids, 8)[:3]
    assert fin["g"].finished_reason == FINISH_STOP()
    assert g.first_scheduled_time is not None and plain.first_scheduled_time is not None
    assert plain.first_scheduled_time <= g.first_scheduled_time


@pytest.mark.parametrize("overlap", [False, True])
def test_only_rows_that_sample_carry_the_matcher(overlap: bool) -> None:
    """A prompt prefilled in chunks feeds its grammar once, at the chunk that reaches its end."""
    sched, comp = _sched(chunked_prefill_size=8, pool_tokens=512)
    comp.ready[("json_schema", SCHEMA)] = CountingMatcher(4)
    long, short = _req("long", n=30, max_new=10), _req("short", n=5, max_new=10)
    sched.add_request(long)
    sched.add_request(short)
    assert not comp.submitted and long.grammar is not None  # compiled before: no wait
    outs = _drain(sched, overlap)
    got, fin = tokens(outs), finals(outs)
    for r in (long, short):
        assert got[r.rid] == expected_tokens(r.origin_input_ids, 10)[:4], r.rid
        assert fin[r.rid].finished_reason == FINISH_STOP()
    runner = sched.runner
    assert isinstance(runner, GrammarEchoRunner)
    chunks = [b for b in runner.batches if "long" in b.rids and not b.is_decode_only]
    assert len(chunks) >= 3
    for b in chunks[:-1]:  # the chunks before the last one sample nothing for "long"
        assert b.sampling.grammars is None or b.sampling.grammars[b.rids.index("long")] is None


def test_a_grammar_that_does_not_compile_is_a_400() -> None:
    sched, comp = _sched()
    sched.add_request(_req("bad"))
    comp.futures[0].set_exception(ValueError("Invalid type: objectx"))
    outs = _drain(sched, overlap=False)
    reason = finals(outs)["bad"].finished_reason
    assert isinstance(reason, FINISH_ABORT) and reason.status_code == 400 and reason.param == "json_schema"
    assert "objectx" in reason.message


@pytest.mark.parametrize("overlap", [False, True])
def test_abort_while_compiling(overlap: bool) -> None:
    sched, comp = _sched()
    sched.add_request(_req("g"))
    sched.step_overlapped() if overlap else sched.step()
    assert sched.has_work() and sched.abort_request("g")
    assert not sched.grammars.pending and not sched.has_work()
    comp.futures[0].set_result(CountingMatcher(3))  # finishes later: nobody waits for it
    outs = list(sched.take_outputs()) + _drain(sched, overlap)
    reason = finals(outs)["g"].finished_reason
    assert isinstance(reason, FINISH_ABORT) and reason.status_code == 499
    assert tokens(outs)["g"] == [] and sched.stats.num_aborted == 1


def test_queue_cap_counts_the_requests_waiting_for_a_grammar() -> None:
    sched, comp = _sched(max_queued_requests=2)
    sched.add_request(_req("g1"))
    sched.add_request(_req("g2"))
    third = _req("g3")
    sched.add_request(third)
    reason = third.finished_reason
    assert isinstance(reason, FINISH_ABORT) and reason.status_code == 429
    for f in comp.futures:
        f.set_result(CountingMatcher(2))
    _drain(sched, overlap=False)


def test_without_a_grammar_engine_the_request_is_refused() -> None:
    sched, _, _ = make_scheduler()
    req = _req("g")
    sched.add_request(req)
    reason = req.finished_reason
    assert isinstance(reason, FINISH_ABORT) and reason.code == "unsupported" and reason.param == "json_schema"
    assert not sched.has_work() and not sched.queues.by_rid


def test_refused_under_disaggregation() -> None:
    sched, comp = _sched(disaggregation_mode="prefill")
    req = _req("g")
    sched.add_request(req)
    reason = req.finished_reason
    assert isinstance(reason, FINISH_ABORT) and reason.code == "unsupported" and "disaggregation" in reason.message
    assert not comp.submitted and not sched.has_work()
