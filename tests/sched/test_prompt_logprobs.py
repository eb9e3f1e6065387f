"""Prompt logprobs (``Req.want_input_logprobs``): every asked-for prompt token's logprob arrives once,
with the request's first row, whatever the batching (chunks, mixed steps, the overlap loop, the
unified scheduler) and however much of the prompt the radix cache holds. ``EchoRunner`` makes up a
logprob from the input token and position each target follows, so a wrong position or target shows."""

from __future__ import annotations

from typing import Any

import pytest

from radixserve.sched.core import SchedulerCore
from radixserve.sched.io import BatchOut, InputLogprobsOut
from radixserve.sched.req import Req
from radixserve.sched.sampling_params import SamplingParams
from tests.fakes import expected_prompt_logprobs, expected_tokens, make_scheduler
from tests.sched.sched_helpers import enter, prompt


def _req(rid: str, ids: list[int], start: int | None, max_new: int = 4, top: int = 0) -> Req:
    req = Req(rid, ids, SamplingParams(max_new_tokens=max_new, top_logprobs_num=top), eos_token_ids=(0,))
    if start is not None:
        req.want_input_logprobs(start)
    return req


def _run(sched: SchedulerCore, reqs: list[Req], overlap: bool = False) -> tuple[dict[str, list[int]], dict[str, list[InputLogprobsOut]]]:
    for r in reqs:
        enter(sched, r)
    toks: dict[str, list[int]] = {}
    got: dict[str, list[InputLogprobsOut]] = {}
    for _ in range(10000):
        out: BatchOut = sched.step_overlapped() if overlap else sched.step()
        for e in out.input_logprobs:
            got.setdefault(e.rid, []).append(e)
        for o in out:
            toks.setdefault(o.rid, []).extend(o.new_token_ids)
        if not sched.has_work():
            sched.step()
            sched.kv.check_invariant()
            return toks, got
    raise AssertionError("did not drain")


def _check(req: Req, got: dict[str, list[InputLogprobsOut]], toks: dict[str, list[int]]) -> None:
    [e] = got[req.rid]  # once
    start = req.input_logprob_start
    assert start is not None
    assert e.start == start and e.token_ids == req.origin_input_ids[start:]
    assert e.logprobs == expected_prompt_logprobs(req.origin_input_ids, start)
    assert toks[req.rid] == expected_tokens(req.origin_input_ids, req.max_new_tokens)  # outputs untouched


@pytest.mark.parametrize("kw", [
    {},
    {"chunked_prefill_size": 16},
    {"chunked_prefill_size": 16, "enable_mixed_chunk": True},
    {"chunked_prefill_size": 16, "page_size": 4},
    {"scheduler": "unified", "max_num_batched_tokens": 24},
], ids=["plain", "chunked", "mixed", "paged", "unified"])
@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_prompt_logprobs_through_every_batching(kw: dict[str, Any], overlap: bool) -> None:
    sched, _, _ = make_scheduler(pool_tokens=512, **kw)
    shared = prompt(1, 40)
    warm = _req("warm", shared + prompt(2, 5), None)
    _run(sched, [warm], overlap)  # the shared prefix is in the radix cache now
    reqs = [
        _req("all", shared + prompt(3, 7), 0, top=2),  # from token 0: nothing cached may be used
        _req("mid", shared + prompt(4, 9), 30),  # from token 30: tokens 0..28 may come from the cache
        _req("last", shared + prompt(5, 3), 47),  # the last prompt token only
        _req("none", shared + prompt(6, 4), None),
        _req("short", prompt(7, 1), 0),  # one token: its logprob is null
    ]
    toks, got = _run(sched, reqs, overlap)
    for r in reqs[:3] + reqs[4:]:
        _check(r, got, toks)
    assert "none" not in got
    by = {r.rid: r for r in reqs}
    assert by["all"].cached_tokens == 0
    assert 0 < by["mid"].cached_tokens <= 29
    assert by["none"].cached_tokens >= 40 - 4  # (a page-aligned match at page 4)
    [e] = got["all"]
    assert e.top_logprobs[0] is None and all(t is not None and len(t) == 2 for t in e.top_logprobs[1:])
    assert got["short"][0].logprobs == [None]


def test_prompt_logprobs_survive_retraction() -> None:
    """A small pool retracts decoding requests; their prompt logprobs were complete before and are
    sent once; a retracted request resumes from the cache (its key is no longer cut)."""
    sched, _, _ = make_scheduler(pool_tokens=64, clip_max_new_tokens=2, chunked_prefill_size=8)
    reqs = [_req(f"r{i}", prompt(20 + i, 6 + i), 0, max_new=30) for i in range(4)]
    toks, got = _run(sched, reqs)
    assert sched.stats.num_retractions > 0
    for r in reqs:
        _check(r, got, toks)
