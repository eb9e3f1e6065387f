"""A runner that raises: the batch it failed is aborted (500, internal_error), nothing it never
computed is cached, and the engine keeps serving."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from radixserve.mem.forward_batch import ForwardBatch, ForwardOutput
from radixserve.sched.core import SchedulerCore
from radixserve.sched.finish import FINISH_ABORT
from radixserve.sched.io import OutRow
from tests.fakes import EchoRunner, drain, expected_tokens, make_scheduler
from tests.sched.sched_helpers import assert_exact, finals, prompt, submit


class FlakyRunner(EchoRunner):
    """Raises on the given forward calls (0-based), otherwise an EchoRunner."""

    def __init__(self, pool: Any, fail_on: set[int]) -> None:
        super().__init__(pool)
        self.fail_on = fail_on
        self.calls = 0

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        n, self.calls = self.calls, self.calls + 1
        if n in self.fail_on:
            raise RuntimeError("device fell over")
        return super().forward(batch)


def flaky(fail_on: set[int], **kw: Any) -> tuple[SchedulerCore, FlakyRunner, Any]:
    sched, runner, kv = make_scheduler(runner=lambda pool: FlakyRunner(pool, fail_on), **kw)
    assert isinstance(runner, FlakyRunner)
    return sched, runner, kv


@pytest.fixture(autouse=True)
def _quiet_scheduler_logs() -> Any:
    logger = logging.getLogger("radixserve.sched.scheduler")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    yield
    logger.setLevel(level)


def _assert_internal_error(out: OutRow) -> None:
    reason = out.finished_reason
    assert isinstance(reason, FINISH_ABORT)
    assert (reason.status_code, reason.err_type, reason.code) == (500, "server_error", "internal_error")


def test_runner_failure_in_prefill_aborts_that_batch_only() -> None:
    sched, runner, kv = flaky({0})
    p = prompt(70, 10)
    submit(sched, "a", p, 5)
    submit(sched, "b", prompt(71, 4), 5)
    outs = list(sched.step())
    assert sorted(o.rid for o in outs) == ["a", "b"]
    for o in outs:
        _assert_internal_error(o)
    assert kv.tree_cache.total_size() == 0  # KV that was never written is not cached
    c = submit(sched, "c", p, 5)
    d = submit(sched, "d", prompt(72, 7), 5)
    outs = drain(sched)
    assert_exact(outs, [c, d])
    assert finals(outs)["c"].cached_tokens == 0
    assert sched.stats.num_aborted == 2


def test_runner_failure_in_decode() -> None:
    sched, runner, kv = flaky({2})
    p = prompt(73, 10)
    a = submit(sched, "a", p, 6)
    sched.step()
    sched.step()
    outs = list(sched.step())  # the failing decode
    assert [o.rid for o in outs] == ["a"]
    _assert_internal_error(outs[0])
    assert a.output_ids == expected_tokens(p, 2)
    assert kv.tree_cache.evictable_size() == 10  # the prompt's KV (computed) stays cached
    b = submit(sched, "b", p, 6)
    outs = drain(sched)
    assert_exact(outs, [b])
    assert finals(outs)["b"].cached_tokens == 9


def test_runner_failure_mid_chunk() -> None:
    sched, runner, kv = flaky({1}, chunked_prefill_size=8, page_size=4)
    p = prompt(74, 20)
    submit(sched, "a", p, 4)
    sched.step()
    outs = list(sched.step())
    _assert_internal_error(outs[0])
    assert sched.queues.chunked is None
    assert kv.tree_cache.evictable_size() == 8  # the first chunk was computed and cached
    b = submit(sched, "b", p, 4)
    outs = drain(sched)
    assert_exact(outs, [b])
    assert finals(outs)["b"].cached_tokens == 8


