"""Requests that are refused, aborted or held back by limits, driven end to end by ``EchoRunner``:
invalid input (refused where it enters, ``request_checks``: a 4xx-style abort that never blocks
others), client aborts wherever the request is (waiting, running, just prefilled, chunked), and the
running and queued caps. Every test that drains checks the KV invariant (drain does)."""

from __future__ import annotations

from typing import Any

import pytest

from radixserve.sched.finish import FINISH_ABORT, FINISH_LENGTH
from radixserve.sched.req import Req
from radixserve.sched.sampling_params import InvalidRequest, SamplingParams
from tests.fakes import drain, expected_tokens, make_scheduler
from tests.sched.sched_helpers import assert_exact, enter, finals, prompt, submit, tokens

# --- invalid requests ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "build, param, code",
    [
        (lambda: Req("bad", []), "prompt", "invalid_request"),
        (lambda: Req("bad", list(range(1, 33))), "prompt", "context_length_exceeded"),  # == context
        (lambda: Req("bad", list(range(1, 40))), "prompt", "context_length_exceeded"),
        (lambda: Req("bad", [1, 2, 1000]), "input_ids", "invalid_request"),
        (lambda: Req("bad", [1, 2, -1]), "input_ids", "invalid_request"),
    ],
)
def test_bad_input_is_aborted_and_never_blocks_others(build: Any, param: str, code: str) -> None:
    sched, runner, kv = make_scheduler(context_len=32)
    good = submit(sched, "good", prompt(15, 5), 6)
    bad = build()
    enter(sched, bad)  # refused where it enters; the scheduler never queues it
    assert bad.finished() and bad.req_pool_idx is None and "bad" not in sched.queues.by_rid
    good2 = submit(sched, "good2", prompt(16, 4), 6)
    outs = drain(sched)
    fin = finals(outs)
    reason = fin["bad"].finished_reason
    assert isinstance(reason, FINISH_ABORT)
    assert (reason.status_code, reason.param, reason.code) == (400, param, code)
    assert tokens(outs)["bad"] == []
    assert_exact([o for o in outs if o.rid != "bad"], [good, good2])
    assert sched.stats.num_aborted == 1


@pytest.mark.parametrize("sp, param", [
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": -3}, "max_new_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"stop_token_ids": [1000]}, "stop_token_ids"),
    ({"stop": [""]}, "stop"),
])
def test_bad_sampling_params_are_refused_where_they_enter(sp: dict[str, Any], param: str) -> None:
    """Sampling params are validated once, by ``SamplingParams.from_dict`` at the edge (HTTP, Engine);
    the scheduler trusts the struct it gets."""
    with pytest.raises(InvalidRequest) as e:
        SamplingParams.from_dict(sp, vocab_size=1000)
    assert e.value.param == param


def test_max_new_tokens_is_clipped_to_the_context() -> None:
    sched, runner, kv = make_scheduler(context_len=32)
    r = submit(sched, "r", prompt(17, 31), 100)
    outs = drain(sched)
    assert r.max_new_tokens == 1
    assert finals(outs)["r"].finished_reason == FINISH_LENGTH(1)


def test_request_needing_the_whole_pool_is_refused_not_stuck() -> None:
    sched, runner, kv = make_scheduler(pool_tokens=64)
    fits = submit(sched, "fits", prompt(18, 10), 53)  # 10 + 53 < 64: admitted
    whole = submit(sched, "whole", prompt(19, 10), 54)  # 10 + 54 == 64: would never be admitted
    over = submit(sched, "over", prompt(20, 10), 60)
    outs = drain(sched, max_steps=500)
    fin = finals(outs)
    for rid in ("whole", "over"):
        reason = fin[rid].finished_reason
        assert isinstance(reason, FINISH_ABORT)
        assert (reason.code, reason.param, reason.status_code) == ("context_length_exceeded", "max_tokens", 400)
    assert_exact([o for o in outs if o.rid == "fits"], [fits])
    assert not whole.output_ids and not over.output_ids


@pytest.mark.parametrize("context_len, pool_tokens", [(512, 64), (64, 64), (40, 64)])
def test_the_http_default_max_tokens_is_one_the_scheduler_admits(context_len: int, pool_tokens: int) -> None:
    """With no max_tokens the HTTP edge asks for as many tokens as fit; the scheduler must then run
    the request, whether the KV pool or the context is the smaller (it once asked for one more than
    the pool holds, refused whenever the pool was not larger than the context)."""
    from types import SimpleNamespace

    from radixserve.server.frontend.common import resolve_max_tokens
    from radixserve.server.frontend.protocol import APIError

    tm: Any = SimpleNamespace(context_len=context_len, info={"max_total_num_tokens": pool_tokens})
    sched, runner, kv = make_scheduler(context_len=context_len, pool_tokens=pool_tokens)
    max_new = resolve_max_tokens(tm, 10, None, "prompt")
    r = submit(sched, "r", prompt(21, 10), max_new)
    outs = drain(sched, max_steps=500)
    assert_exact(outs, [r])
    assert max_new == min(context_len, pool_tokens - 1) - 10  # and it is the most that fits
    with pytest.raises(APIError) as e:  # a prompt that leaves no room is refused at the edge
        resolve_max_tokens(tm, min(context_len, pool_tokens - 1), None, "prompt")
    assert (e.value.param, e.value.code) == ("prompt", "context_length_exceeded")


def test_sampling_params_from_dict_rejects_unknown_types() -> None:
    with pytest.raises(InvalidRequest) as e:
        SamplingParams.from_dict({"stop": 5})
    assert e.value.param == "stop"
    with pytest.raises(InvalidRequest) as e:
        SamplingParams.from_dict({"bogus": 1})
    assert e.value.param == "bogus"
    with pytest.raises(InvalidRequest):
        SamplingParams.from_dict({"stop": ["a", 3]})
    with pytest.raises(InvalidRequest):
        SamplingParams.from_dict({"max_new_tokens": True})
    assert SamplingParams.from_dict({"stop": "x"}).stop == ["x"]
    assert SamplingParams.from_dict({"stop": None, "stop_token_ids": None}).stop == []
    assert SamplingParams.from_dict(None) == SamplingParams()


def test_duplicate_rid_is_refused_and_the_original_stays_abortable() -> None:
    sched, runner, kv = make_scheduler()
    a = submit(sched, "a", prompt(21, 5), 6)
    dup = submit(sched, "a", prompt(22, 5), 6)
    assert isinstance(dup.finished_reason, FINISH_ABORT) and dup.finished_reason.param == "rid"
    assert sched.queues.by_rid["a"] is a
    outs = drain(sched)
    assert tokens(outs)["a"] == expected_tokens(a.origin_input_ids, 6)
    assert a.finished_reason == FINISH_LENGTH(6)
    # After the original finished, the id is free again.
    again = submit(sched, "a", prompt(22, 5), 3)
    assert not again.finished()
    drain(sched)
    # A refused duplicate must not unregister the running original.
    sched2, _, _ = make_scheduler()
    orig = submit(sched2, "x", prompt(23, 5), 6)
    submit(sched2, "x", prompt(24, 5), 6)
    assert sched2.abort_request("x") is True
    outs = drain(sched2)
    assert isinstance(orig.finished_reason, FINISH_ABORT) and orig.finished_reason.code == "aborted"


# --- aborts ----------------------------------------------------------------------------------


def test_abort_waiting_request() -> None:
    sched, runner, kv = make_scheduler(max_running_requests=1)
    a = submit(sched, "a", prompt(25, 5), 4)
    b = submit(sched, "b", prompt(26, 5), 4)
    sched.step()
    assert sched.queues.waiting == [b]
    assert sched.abort_request("b") is True
    assert sched.abort_request("b") is False  # already gone
    assert sched.abort_request("nope") is False
    assert b.finished() and sched.queues.waiting == []
    outs = drain(sched)
    fin = finals(outs)
    reason = fin["b"].finished_reason
    assert isinstance(reason, FINISH_ABORT) and (reason.status_code, reason.code) == (499, "aborted")
    assert tokens(outs)["b"] == []
    assert a.output_ids == expected_tokens(a.origin_input_ids, 4)
    assert b.req_pool_idx is None and b.output_ids == []
    assert [x.batch_size for x in runner.batches] == [1, 1, 1, 1]  # b never ran


def test_abort_running_request() -> None:
    sched, runner, kv = make_scheduler()
    a = submit(sched, "a", prompt(27, 6), 10)
    b = submit(sched, "b", prompt(28, 6), 10)
    sched.step()
    sched.step()
    assert len(a.output_ids) == 2
    assert sched.abort_request("a") is True
    outs = list(sched.step())
    assert [(o.rid, o.new_token_ids) for o in outs if o.rid == "a"] == [("a", [])]
    assert isinstance(a.finished_reason, FINISH_ABORT)
    assert a.output_ids == expected_tokens(a.origin_input_ids, 2)
    assert runner.batches[-1].batch_size == 1  # only b decoded
    drain(sched)
    assert b.output_ids == expected_tokens(b.origin_input_ids, 10)


def test_abort_right_after_prefill_takes_effect_next_step() -> None:
    sched, runner, kv = make_scheduler()
    a = submit(sched, "a", prompt(29, 6), 10)
    sched.step()  # prefill: a is still in last_batch, not yet merged into the running batch
    assert sched.abort_request("a")
    outs = drain(sched)
    assert [(o.rid, o.new_token_ids) for o in outs] == [("a", [])]  # no token after the abort
    assert len(a.output_ids) == 1
    assert len(runner.batches) == 1


def test_abort_chunked_request() -> None:
    sched, runner, kv = make_scheduler(chunked_prefill_size=8)
    a = submit(sched, "a", prompt(30, 30), 4)
    sched.step()
    assert sched.queues.chunked is a
    assert sched.abort_request("a")
    b = submit(sched, "b", prompt(31, 5), 4)
    outs = drain(sched)
    assert isinstance(finals(outs)["a"].finished_reason, FINISH_ABORT)
    assert sched.queues.chunked is None
    assert_exact([o for o in outs if o.rid == "b"], [b])
    assert kv.tree_cache.evictable_size() == 8 + 5 + 3  # a's computed chunk stays cached, and b


# --- limits ----------------------------------------------------------------------------------


def test_max_running_requests_respected() -> None:
    sched, runner, kv = make_scheduler(max_running_requests=2)
    reqs = [submit(sched, f"r{i}", prompt(40 + i, 4 + i), 3 + i % 3) for i in range(5)]
    outs = drain(sched)
    assert_exact(outs, reqs)
    assert max(b.batch_size for b in runner.batches) == 2
    assert sched.queues.max_running_requests == 2


def test_max_running_requests_capped_by_request_pool() -> None:
    sched, runner, kv = make_scheduler(max_reqs=3)
    assert sched.queues.max_running_requests == 3
    reqs = [submit(sched, f"r{i}", prompt(45 + i, 4), 3) for i in range(5)]
    assert_exact(drain(sched), reqs)
    assert max(b.batch_size for b in runner.batches) == 3


def test_max_queued_requests_rejects_with_429() -> None:
    sched, runner, kv = make_scheduler(max_queued_requests=2)
    a = submit(sched, "a", prompt(50, 4), 3)
    b = submit(sched, "b", prompt(51, 4), 3)
    c = submit(sched, "c", prompt(52, 4), 3)
    reason = c.finished_reason
    assert isinstance(reason, FINISH_ABORT)
    assert (reason.status_code, reason.err_type, reason.code) == (429, "rate_limit_error", "queue_full")
    outs = list(sched.step())  # a and b leave the queue
    d = submit(sched, "d", prompt(53, 4), 3)
    assert not d.finished()
    outs += drain(sched)
    assert_exact([o for o in outs if o.rid != "c"], [a, b, d])
