"""Helpers for the scheduling-policy tests (test_policies, test_priority, test_unified)."""

from __future__ import annotations

import itertools

from radixserve.sched.core import SchedulerCore
from radixserve.sched.finish import FINISH_ABORT
from radixserve.sched.io import OutRow
from radixserve.sched.req import Req
from radixserve.sched.sampling_params import SamplingParams
from radixserve.sched.schedule_batch import ScheduleBatch
from tests.fakes import expected_tokens
from tests.sched import sched_helpers

prompt = sched_helpers.prompt  # the policy tests import these from here
tokens = sched_helpers.tokens
_arrivals = itertools.count()


def submit(
    sched: SchedulerCore, rid: str, prompt: list[int], max_new: int = 4, *, priority: int | None = None,
    arrival: float | None = None,
) -> Req:
    """Queue a request; arrival times increase in submission order unless given."""
    req = Req(rid, prompt, SamplingParams(max_new_tokens=max_new),
              arrival_time=float(next(_arrivals)) if arrival is None else arrival, priority=priority)
    sched.add_request(req)
    return req


def aborts(outs: list[OutRow]) -> dict[str, FINISH_ABORT]:
    return {o.rid: o.finished_reason for o in outs if isinstance(o.finished_reason, FINISH_ABORT)}


def assert_exact(outs: list[OutRow], reqs: list[Req]) -> None:
    """Every request produced exactly what EchoRunner gives it alone (order never changes outputs)."""
    got = tokens(outs)
    for r in reqs:
        assert got.get(r.rid, []) == expected_tokens(r.origin_input_ids, r.max_new_tokens), r.rid


class BatchLog:
    """Records every batch the scheduler builds: ``steps[i]`` is ``[(rid, prefix_len, extend_len)]``."""

    def __init__(self, sched: SchedulerCore) -> None:
        self.steps: list[list[tuple[str, int, int]]] = []
        self.modes: list[str] = []
        inner = sched.get_next_batch_to_run

        def wrapped() -> ScheduleBatch | None:
            batch = inner()
            if batch is not None:
                self.steps.append(list(zip([r.rid for r in batch.reqs], batch.prefix_lens, batch.extend_lens,
                                           strict=True)))
                self.modes.append(batch.forward_mode.name)
            return batch

        sched.get_next_batch_to_run = wrapped  # type: ignore[method-assign]

    def rids(self, step: int) -> list[str]:
        return [rid for rid, _, _ in self.steps[step]]

    def extend_lens(self) -> list[list[int]]:
        return [[n for _, _, n in s] for s in self.steps]

    def admissions(self) -> list[str]:
        """rids in the order they first appear in a batch."""
        seen: list[str] = []
        for s in self.steps:
            for rid, _, _ in s:
                if rid not in seen:
                    seen.append(rid)
        return seen
