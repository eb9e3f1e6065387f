"""Helpers of the end-to-end scheduler tests (test_scheduler.py, test_admission.py)."""

from __future__ import annotations

import random
from typing import Any

from radixserve.sched.core import SchedulerCore
from radixserve.sched.finish import FINISH_LENGTH
from radixserve.sched.io import OutRow
from radixserve.sched.req import Req
from radixserve.sched.request_checks import check_request
from radixserve.sched.sampling_params import SamplingParams
from tests.fakes import expected_tokens


def submit(sched: SchedulerCore, rid: str, prompt: list[int], max_new: int = 8, **sp: Any) -> Req:
    eos = sp.pop("eos", ())
    req = Req(rid, prompt, SamplingParams(max_new_tokens=max_new, **sp), eos_token_ids=eos)
    enter(sched, req)
    return req


def enter(sched: SchedulerCore, req: Req) -> None:
    """What an engine's edge does (``Engine.generate``, the HTTP front end): check the request
    (``request_checks``), then queue it, or finish it at once with the refusal."""
    err = check_request(req, sched.limits())
    if err is None:
        sched.add_request(req)
    else:
        sched.finish(req, err)


def tokens(outs: list[OutRow]) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    for o in outs:
        got.setdefault(o.rid, []).extend(o.new_token_ids)
    return got


def finals(outs: list[OutRow]) -> dict[str, OutRow]:
    fin = {o.rid: o for o in outs if o.finished_reason is not None}
    assert len(fin) == len([o for o in outs if o.finished_reason is not None]), "a request finished twice"
    return fin


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(n)]


def assert_exact(outs: list[OutRow], reqs: list[Req]) -> None:
    got, fin = tokens(outs), finals(outs)
    for r in reqs:
        assert got[r.rid] == expected_tokens(r.origin_input_ids, r.max_new_tokens), r.rid
        assert fin[r.rid].finished_reason == FINISH_LENGTH(r.max_new_tokens)
        assert fin[r.rid].completion_tokens == r.max_new_tokens
