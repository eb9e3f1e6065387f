"""The scheduler's managers alone (``parts.build_parts``, no ``SchedulerCore`` and no batch
builder): each one's promises, driven by hand as a builder would drive them."""

from __future__ import annotations

from typing import Any

from radixserve.config import ServerArgs
from radixserve.mem.forward_batch import ForwardOutput
from radixserve.sched.build import build_kv
from radixserve.sched.finish import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP
from radixserve.sched.parts import SchedParts, build_parts
from radixserve.sched.req import Req
from radixserve.sched.request_checks import Limits, check_request, max_new_tokens
from radixserve.sched.sampling_params import SamplingParams
from radixserve.sched.schedule_batch import ForwardMode, ScheduleBatch
from tests.fakes import EchoRunner, expected_tokens


def parts(pool_tokens: int = 128, max_reqs: int = 4, **kw: Any) -> tuple[SchedParts, list[float]]:
    """The managers over a small KV pool, an ``EchoRunner`` and a clock the test moves."""
    args = ServerArgs(**kw)
    kv = build_kv(args, pool_tokens, 64, max_reqs=max_reqs)
    now = [0.0]
    p = build_parts(args, EchoRunner(kv.req_to_token_pool), kv, context_len=64,
                    eos_token_ids=[0], clock=lambda: now[0])
    return p, now


def req(rid: str, n: int = 6, max_new: int = 4, priority: int | None = None, **sp: Any) -> Req:
    r = Req(rid, [10 + i for i in range(n)], SamplingParams(max_new_tokens=max_new, **sp))
    r.priority = priority
    return r


def prefill(p: SchedParts, reqs: list[Req]) -> ScheduleBatch:
    """What a builder does to prefill ``reqs`` from the waiting queue: match, admit, take slots."""
    batch = ScheduleBatch(list(reqs), ForwardMode.EXTEND)
    for r in reqs:
        p.kv.match(r)
        p.kv.lock_match(r)
        p.admit(r)
        batch.prefix_lens.append(r.num_computed_tokens)
        batch.extend_lens.append(r.extend_input_len)
        batch.out_slots.extend(p.kv.grow(r, r.extend_input_len))
    p.queues.remove_waiting(reqs)
    return batch


def decode(p: SchedParts, reqs: list[Req]) -> ScheduleBatch:
    batch = ScheduleBatch(list(reqs), ForwardMode.DECODE)
    batch.prefix_lens, batch.out_slots = p.kv.grow_decode(batch.reqs)
    batch.extend_lens = [1] * len(reqs)
    return batch


def run(p: SchedParts, batch: ScheduleBatch) -> None:
    p.outputs.process_batch_result(batch, p.runner.forward(batch.to_forward_batch()))


# --- Intake --------------------------------------------------------------------------------------
def test_intake_queues_what_the_edge_checked_and_refuses_only_on_live_state() -> None:
    """The prompt, the vocabulary, the context and the KV pool are the edge's checks
    (``request_checks``): the intake trusts them and refuses only what its live state says."""
    p, _ = parts(pool_tokens=64)
    ok = req("ok")
    assert p.intake.add(ok) and p.queues.waiting == [ok] and p.queues.by_rid == {"ok": ok}
    assert ok.eos_token_ids == frozenset({0})  # the model's stop tokens, where the request named none
    assert not p.intake.add(req("ok"))  # a duplicate id: the original stays
    (row,) = p.outputs.take()
    assert isinstance(row.finished_reason, FINISH_ABORT) and row.finished_reason.param == "rid"
    assert p.queues.waiting == [ok] and p.queues.by_rid == {"ok": ok}


def test_the_edge_checks_refuse_what_cannot_run_here_and_clip_the_output_budget() -> None:
    limits = Limits(vocab_size=1000, context_len=64, pool_tokens=64)
    refused = {
        "empty": (Req("empty", [], SamplingParams(max_new_tokens=4)), "prompt"),
        "vocab": (Req("vocab", [5, 1000], SamplingParams(max_new_tokens=4)), "input_ids"),
        "context": (req("context", n=64), "prompt"),
        "pool": (req("pool", n=40, max_new=24), "max_tokens"),  # 40 + 24 = 64: not below the 64-slot pool
    }
    for r, param in refused.values():
        err = check_request(r, limits)
        assert isinstance(err, FINISH_ABORT) and err.param == param and err.status_code == 400
    clipped = req("clipped", n=40, max_new=500)
    assert check_request(clipped, Limits(1000, 50, 4096)) is None and clipped.max_new_tokens == 10
    assert max_new_tokens(40, None, limits) == 23  # none asked: as many as fit
    strict = max_new_tokens(40, 30, limits, clip=False, param="max_tokens")  # OpenAI's rule: refuse
    assert isinstance(strict, FINISH_ABORT) and strict.code == "context_length_exceeded"


def test_intake_queue_cap_gives_a_more_important_newcomer_the_least_important_place() -> None:
    p, _ = parts(max_queued_requests=2, enable_priority_scheduling=True)
    a, b = req("a", priority=5), req("b", priority=1)
    assert p.intake.add(a) and p.intake.add(b)
    assert not p.intake.add(req("c", priority=1))  # no more important than the least important: refused
    assert p.intake.add(req("d", priority=9))  # more important: b (least important) gives its place
    assert [r.rid for r in p.queues.waiting] == ["a", "d"]
    codes = {o.rid: o.finished_reason.code for o in p.outputs.take()}
    assert codes == {"c": "queue_full", "b": "queue_full_preempted"}


def test_intake_abort_of_a_waiting_request_ends_it_at_once_and_a_running_one_at_the_next_step() -> None:
    p, _ = parts()
    w, r = req("w"), req("r")
    p.intake.add(w)
    p.intake.add(r)
    p.queues.running.extend([r])
    run(p, prefill(p, [r]))
    p.outputs.take()
    assert p.intake.abort("w") and w.finished() and p.queues.waiting == []
    assert p.intake.abort("r") and not r.finished()  # flagged only
    p.intake.apply_aborts()
    assert r.finished() and isinstance(r.finished_reason, FINISH_ABORT) and r.finished_reason.status_code == 499
    p.kv.check_invariant()


def test_intake_queue_timeout_uses_the_shared_clock() -> None:
    p, now = parts(queue_timeout=2.0)
    a = req("a")
    p.intake.add(a)
    now[0] = 1.9
    p.intake.abort_timed_out()
    assert not a.finished()
    now[0] = 2.1
    p.intake.abort_timed_out()
    assert isinstance(a.finished_reason, FINISH_ABORT) and a.finished_reason.code == "queue_timeout"


# --- Outputs -------------------------------------------------------------------------------------
def test_outputs_turn_results_into_tokens_finish_by_length_and_stop_token_and_free_the_kv() -> None:
    p, _ = parts()
    a = req("a", max_new=3)
    b = req("b", max_new=50, stop_token_ids=[expected_tokens([10 + i for i in range(6)], 5)[4]])
    for r in (a, b):
        p.intake.add(r)
    batch = prefill(p, [a, b])
    run(p, batch)
    live = [a, b]
    for _ in range(3):
        run(p, decode(p, live))
        live = [r for r in live if not r.finished()]
    assert a.output_ids == expected_tokens(a.origin_input_ids, 3) and a.finished_reason == FINISH_LENGTH(3)
    run(p, decode(p, [b]))
    assert isinstance(b.finished_reason, FINISH_STOP) and len(b.output_ids) == 5
    assert p.queues.by_rid == {} and p.kv.req_to_token_pool.available_size() == 4
    p.kv.check_invariant()
    rows = p.outputs.take()
    assert [o.rid for o in rows if o.finished_reason is not None] == ["a", "b"]


# --- ForwardThread -------------------------------------------------------------------------------
def test_forward_thread_resolves_placeholders_and_holds_what_ends_in_flight() -> None:
    p, _ = parts()
    a = req("a", max_new=8)
    p.intake.add(a)
    fwd = p.forward
    first = prefill(p, [a])
    fwd.launch(first, None)
    step1 = fwd.in_flight
    assert step1 is not None and fwd.includes(a)
    second = decode(p, [a])  # built before step 1's token is known: a placeholder stands for it
    fwd.launch(second, step1)
    step2 = fwd.in_flight
    assert step2 is not None and fwd.take() is step2 and fwd.in_flight is None
    out1, dt1 = fwd.result(step1)
    out2, _ = fwd.result(step2)
    want = expected_tokens(a.origin_input_ids, 2)
    assert out1.next_token_ids == want[:1] and out2.next_token_ids == want[1:] and dt1 >= 0.0
    p.outputs.process_batch_result(step1.batch, out1)
    p.outputs.process_batch_result(step2.batch, out2)
    assert a.output_ids == want
    # a request ending while a forward includes it keeps its KV until that forward is done
    fwd.launch(decode(p, [a]), None)
    kv_used = p.kv.total_tokens - p.kv.available_size()
    p.outputs.end(a, FINISH_ABORT("gone"))
    assert fwd.held == [a] and p.kv.total_tokens - p.kv.available_size() == kv_used
    fwd.release_held()
    assert fwd.held == [a]  # still in flight
    step = fwd.take()
    assert step is not None
    fwd.result(step)
    fwd.release_held()
    assert fwd.held == [] and p.kv.req_to_token_pool.available_size() == 4
    p.kv.check_invariant()


def test_forward_thread_placeholder_of_a_failed_step_fails_the_next() -> None:
    p, _ = parts()
    a = req("a")
    p.intake.add(a)

    class Boom(EchoRunner):
        def forward(self, batch: Any) -> ForwardOutput:
            raise RuntimeError("device fell over")

    fwd = p.forward
    fwd.runner = Boom(p.kv.req_to_token_pool)
    fwd.launch(prefill(p, [a]), None)
    first = fwd.in_flight
    assert first is not None
    fwd.launch(decode(p, [a]), first)
    second = fwd.take()
    assert second is not None
    for step, message in ((first, "device fell over"), (second, "the step this one continues failed")):
        try:
            fwd.result(step)
        except RuntimeError as e:
            assert str(e) == message
        else:
            raise AssertionError("the forward should have failed")


# --- Preemption ----------------------------------------------------------------------------------
def test_preemption_evict_sends_a_running_request_back_with_its_kv_cached() -> None:
    p, _ = parts()
    a = req("a", n=8)
    p.intake.add(a)
    p.queues.running.extend([a])
    run(p, prefill(p, [a]))
    p.preemption.evict(a)
    assert a.req_pool_idx is None and a.num_preemptions == 1 and p.stats.num_preemptions == 1
    assert p.kv.uncached_tokens(a) == 1  # its prompt stayed in the radix cache: one token to recompute
    p.kv.check_invariant()


def test_preemption_retract_decode_keeps_the_survivors_headroom() -> None:
    p, _ = parts(pool_tokens=40, retract_decode_steps=4)
    reqs = [req(c, n=8, max_new=20) for c in "abc"]
    for r in reqs:
        p.intake.add(r)
    batch = prefill(p, reqs)
    run(p, batch)
    p.queues.running.extend(reqs)
    retracted, ratio = p.preemption.retract_decode(p.queues.running)
    assert retracted and set(retracted) <= set(reqs) and retracted == p.queues.waiting
    left = p.queues.running.reqs
    assert left and p.kv.decode_tokens_needed(left, 4) <= p.kv.reclaimable_size()
    assert 0.0 < ratio <= 1.0 and p.stats.num_retractions == len(retracted)
    for r in left:
        p.outputs.end(r, FINISH_ABORT("done"))
    for r in retracted:
        p.intake.abort(r.rid)
    p.kv.check_invariant()


# --- Ordering ------------------------------------------------------------------------------------
def test_ordering_ages_waiting_requests_by_the_shared_clock() -> None:
    p, _ = parts(enable_priority_scheduling=True, priority_aging_rate=1.0)
    old, new = req("old", priority=1), req("new", priority=3)
    new.arrival_time = new.queue_entry_time = 13.0
    old.arrival_time = old.queue_entry_time = 12.0  # 1 s of wait: one unit, not the two it lacks
    assert [r.rid for r in p.ordering.order([old, new], now=13.0)] == ["new", "old"]
    old.arrival_time = old.queue_entry_time = 10.0  # 3 s of wait: three units
    assert [r.rid for r in p.ordering.order([old, new], now=13.0)] == ["old", "new"]
    assert p.ordering.context(5.0).prio is p.settings.prio
