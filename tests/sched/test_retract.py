"""Decode retraction (``sched/retract.py``): SGLang's victim order, headroom for the survivors,
``new_token_ratio`` raised and decayed back, a lone request out of memory aborted."""

from __future__ import annotations

from typing import Any

import pytest

from radixserve.sched.core import SchedulerCore
from radixserve.sched.finish import FINISH_ABORT
from radixserve.sched.req import Req
from radixserve.sched.schedule_batch import ForwardMode
from tests.fakes import EchoRunner, drain, expected_tokens, make_scheduler
from tests.sched.sched_helpers import assert_exact, finals, prompt, submit, tokens


def test_small_pool_retracts_and_outputs_stay_exact() -> None:
    sched, runner, kv = make_scheduler(pool_tokens=48, clip_max_new_tokens=2)
    reqs = [submit(sched, f"r{i}", prompt(200 + i, 6), 30) for i in range(4)]
    outs = drain(sched)
    assert sched.stats.num_retractions > 0
    assert_exact(outs, reqs)
    assert sum(finals(outs)[r.rid].num_retractions for r in reqs) == sched.stats.num_retractions


def test_small_pool_retracts_paged_chunked() -> None:
    sched, runner, kv = make_scheduler(pool_tokens=64, page_size=4, chunked_prefill_size=8, clip_max_new_tokens=4)
    reqs = [submit(sched, f"r{i}", prompt(300 + i, 5 + i), 40) for i in range(6)]
    outs = drain(sched)
    assert sched.stats.num_retractions > 0
    assert_exact(outs, reqs)


def _three_running(steps: int, decay_steps: int = 100) -> tuple[SchedulerCore, EchoRunner, Any, list[Req], list[int]]:
    """r1 (prompt 9, 2 outputs), r2 (prompt 5, 1 output), r3 (prompt 7, 1 output), all running,
    and every other KV slot taken (returned as the hog)."""
    sched, runner, kv = make_scheduler(pool_tokens=128, retract_decode_steps=steps,
                                       new_token_ratio_decay_steps=decay_steps)
    r1 = submit(sched, "r1", prompt(11, 9), 20)
    sched.step()
    sched.step()
    r2 = submit(sched, "r2", prompt(12, 5), 20)
    r3 = submit(sched, "r3", prompt(13, 7), 20)
    sched.step()
    assert [len(r.output_ids) for r in (r1, r2, r3)] == [2, 1, 1]
    assert kv.tree_cache.evictable_size() == 0
    hog = kv.allocator.alloc(kv.available_size())
    return sched, runner, kv, [r1, r2, r3], hog


def test_retraction_victim_fewest_outputs_then_longest_prompt() -> None:
    sched, runner, kv, (r1, r2, r3), hog = _three_running(steps=1)
    sched.step()
    # r3 and r2 have the fewest outputs; r3 has the longer prompt. r1 (longest prompt) is safe.
    assert sched.queues.waiting == [r3]
    assert sched.queues.running.reqs == [r1, r2]
    assert (r1.num_retractions, r2.num_retractions, r3.num_retractions) == (0, 0, 1)
    assert sched.stats.num_retractions == 1
    assert r3.req_pool_idx is None and r3.kv_indices == [] and r3.last_node is None
    assert sched.cur_batch is not None and sched.cur_batch.forward_mode is ForwardMode.DECODE
    assert runner.batches[-1].batch_size == 2
    # SGLang's estimate (decoded 2+1 + steps 1 * 2 survivors) / (max_new 20+20 + 1) = 5/41 is below
    # the ratio (0.7 after one decay step of 0.7 * 0.86 / 100): a retraction never lowers it
    assert sched.builder.new_token_ratio == pytest.approx(0.7 - 0.7 * 0.86 / 100)
    kv.allocator.free(hog)
    outs = drain(sched)
    fin = finals(outs)
    assert fin["r3"].num_retractions == 1
    got = tokens(outs)
    assert got["r3"] == expected_tokens(r3.origin_input_ids, 20)[1:]  # its first token came before
    assert r1.output_ids == expected_tokens(r1.origin_input_ids, 20)
    assert r2.output_ids == expected_tokens(r2.origin_input_ids, 20)
    assert r3.output_ids == expected_tokens(r3.origin_input_ids, 20)


def test_retraction_keeps_going_until_survivors_have_headroom() -> None:
    sched, runner, kv, (r1, r2, r3), hog = _three_running(steps=20)
    sched.step()
    # After r3 (7 slots back): 2 survivors need 40 > 7, so r2 goes too; one survivor needs 1 step only.
    assert sched.queues.waiting == [r3, r2]
    assert sched.queues.running.reqs == [r1]
    assert sched.stats.num_retractions == 2
    assert sched.builder.new_token_ratio == 1.0  # raised to min(1, (2 + 20) / (20 + 1))
    kv.allocator.free(hog)
    drain(sched)
    for r in (r1, r2, r3):
        assert r.output_ids == expected_tokens(r.origin_input_ids, 20)


def test_new_token_ratio_decays_per_decode_step_to_the_floor() -> None:
    sched, runner, kv, (r1, r2, r3), hog = _three_running(steps=20, decay_steps=10)
    init, floor = 0.7, 0.7 * 0.14
    decay = (init - floor) / 10
    assert (sched.builder.init_new_token_ratio, sched.builder.min_new_token_ratio) == (pytest.approx(init), pytest.approx(floor))
    assert sched.builder.new_token_ratio_decay == pytest.approx(decay)
    assert sched.builder.new_token_ratio == pytest.approx(init - decay)  # one decode step so far (r1's)
    sched.step()  # the retraction raises it: to SGLang's estimate min(1, (2 + 20 * 1) / (20 + 1)) = 1
    assert sched.stats.num_retractions == 2 and sched.queues.running.reqs == [r1]
    assert sched.builder.new_token_ratio == 1.0
    kv.allocator.free(hog)
    decodes = 0
    ratios = [1.0]
    while sched.has_work():
        before, retractions = sched.builder.new_token_ratio, sched.stats.num_retractions
        sched.step()
        assert sched.stats.num_retractions == retractions
        if sched.cur_batch is not None and sched.cur_batch.forward_mode is ForwardMode.DECODE:
            decodes += 1
            assert sched.builder.new_token_ratio == pytest.approx(max(before - decay, floor))
            ratios.append(sched.builder.new_token_ratio)
        elif sched.cur_batch is None and not sched.has_work():
            assert sched.builder.new_token_ratio == init  # reset when the engine goes idle
        else:
            assert sched.builder.new_token_ratio == before
    # then decayed back, one step of (init - floor) / 10 per decode step: floor after 15 of them
    assert ratios[:4] == [1.0, pytest.approx(1.0 - decay), pytest.approx(1.0 - 2 * decay),
                          pytest.approx(1.0 - 3 * decay)]
    assert decodes > 15 and ratios[15] == pytest.approx(floor) and ratios[14] > floor + 1e-9
    drain(sched)
    assert sched.builder.new_token_ratio == init


def test_retraction_raises_new_token_ratio_from_the_floor_to_the_estimate() -> None:
    sched, runner, kv, (r1, r2, r3), hog = _three_running(steps=1, decay_steps=1)
    floor = 0.7 * 0.14
    assert sched.builder.new_token_ratio == pytest.approx(floor)  # one decode step of (0.7 - floor) / 1
    sched.step()
    assert sched.queues.waiting == [r3]
    # SGLang's estimate: (decoded 2+1 + steps 1 * 2 survivors) / (max_new 20+20 + 1) > floor
    assert sched.builder.new_token_ratio == pytest.approx(5 / 41)
    kv.allocator.free(hog)
    sched.step()  # r3 comes back (prefill): no decode, no decay
    assert sched.cur_batch is not None and sched.cur_batch.forward_mode is ForwardMode.EXTEND
    assert sched.builder.new_token_ratio == pytest.approx(5 / 41)
    sched.step()  # a decode step: back to the floor
    assert sched.cur_batch is not None and sched.cur_batch.forward_mode is ForwardMode.DECODE
    assert sched.builder.new_token_ratio == pytest.approx(floor)
    drain(sched)
    for r in (r1, r2, r3):
        assert r.output_ids == expected_tokens(r.origin_input_ids, 20)


def test_single_request_out_of_memory_is_aborted() -> None:
    sched, runner, kv = make_scheduler(pool_tokens=32, idle_self_check=False)  # the hog is no leak
    a = submit(sched, "a", prompt(14, 6), 10)
    sched.step()
    hog = kv.allocator.alloc(kv.available_size())
    outs = list(sched.step())
    assert [o.rid for o in outs] == ["a"]
    reason = outs[0].finished_reason
    assert isinstance(reason, FINISH_ABORT) and (reason.status_code, reason.code) == (500, "out_of_memory")
    assert a.req_pool_idx is None
    kv.allocator.free(hog)
    drain(sched)
