"""``Scheduler`` driven end to end by ``EchoRunner``: exact outputs, exact cache hits, streaming
and non-streaming outputs, stop conditions (refused, aborted and capped requests:
test_admission.py; retraction: test_retract.py; a failing runner: test_runner_failures.py). Every
test that drains checks the KV invariant (drain does)."""

from __future__ import annotations

import random

import pytest

from radixserve.mem.base_cache import ChunkCache
from radixserve.mem.forward_batch import ForwardBatch
from radixserve.sched.finish import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP
from radixserve.sched.io import OutRow
from radixserve.sched.req import Req
from radixserve.sched.sampling_params import SamplingParams
from radixserve.sched.schedule_batch import ForwardMode, ScheduleBatch
from tests.fakes import drain, expected_tokens, make_scheduler
from tests.sched.sched_helpers import assert_exact, finals, prompt, submit, tokens

# --- outputs ---------------------------------------------------------------------------------


def test_one_at_a_time() -> None:
    sched, runner, kv = make_scheduler()
    for i, (n, m) in enumerate([(1, 1), (5, 3), (17, 9), (40, 12)]):
        r = submit(sched, f"r{i}", prompt(i, n), m)
        outs = drain(sched)
        assert_exact(outs, [r])
        assert [o.new_token_ids for o in outs] == [[t] for t in expected_tokens(r.origin_input_ids, m)]
    assert sched.stats.num_finished == 4 and sched.stats.num_aborted == 0


def test_many_at_once() -> None:
    sched, runner, kv = make_scheduler()
    reqs = [submit(sched, f"r{i}", prompt(100 + i, 3 + 2 * i), 4 + i) for i in range(8)]
    outs = drain(sched)
    assert_exact(outs, reqs)
    assert runner.batches[0].batch_size == 8
    assert runner.batches[0].extend_seq_lens == [3 + 2 * i for i in range(8)]
    assert runner.batches[1].extend_seq_lens == [1] * 8
    assert sched.stats.prefill_steps == 1
    assert sched.stats.decode_steps == 4 + 7 - 1


def test_shared_prefix_is_cached_exactly() -> None:
    sched, runner, kv = make_scheduler()
    p = prompt(1, 20)
    a = submit(sched, "a", p, 5)
    assert_exact(drain(sched), [a])
    out_a = expected_tokens(p, 5)
    # The tree now holds a's prompt and its first 4 outputs (the 5th never got KV).
    assert kv.tree_cache.evictable_size() == 24
    b = submit(sched, "b", p + [501, 502, 503, 504, 505], 5)
    outs = drain(sched)
    assert_exact(outs, [b])
    assert finals(outs)["b"].cached_tokens == 20
    c = submit(sched, "c", p, 5)  # the same prompt: all but the last token (its logits are needed)
    outs = drain(sched)
    assert_exact(outs, [c])
    assert finals(outs)["c"].cached_tokens == 19
    d = submit(sched, "d", p + out_a[:4] + [7], 3)  # a's outputs are cached too
    outs = drain(sched)
    assert_exact(outs, [d])
    assert finals(outs)["d"].cached_tokens == 24
    assert sched.stats.cached_tokens == 20 + 19 + 24
    assert sched.stats.prompt_tokens == 20 + 25 + 20 + 25
    # The runner computed only the uncached part.
    assert runner.batches[-3].extend_prefix_lens == [24] and runner.batches[-3].extend_seq_lens == [1]


def test_prefix_shared_within_a_run() -> None:
    sched, runner, kv = make_scheduler()
    q = prompt(2, 16)
    e = submit(sched, "e", q, 6)
    f = submit(sched, "f", q, 6)
    outs = list(sched.step())  # both prefilled in one batch: nothing to share yet
    g = submit(sched, "g", q + [9], 6)  # the prompt became shareable right after its prefill
    outs += drain(sched)
    assert_exact(outs, [e, f, g])
    fin = finals(outs)
    assert (e.cached_tokens, f.cached_tokens, fin["g"].cached_tokens) == (0, 0, 16)


def test_chunked_prefill_runs_chunks_of_exactly_8() -> None:
    sched, runner, kv = make_scheduler(chunked_prefill_size=8)
    long = submit(sched, "long", prompt(3, 20), 4)
    short = submit(sched, "short", prompt(4, 3), 4)
    outs = drain(sched)
    assert_exact(outs, [long, short])
    ext = [b.extend_seq_lens for b in runner.batches]
    pre = [b.extend_prefix_lens for b in runner.batches]
    assert ext[:3] == [[8], [8], [4, 3]]  # the short one joins the last chunk's batch
    assert pre[:3] == [[0], [8], [16, 0]]
    assert all(e == [1, 1] for e in ext[3:])
    assert len(runner.batches) == 3 + 3
    assert tokens(outs)["long"][0] == expected_tokens(long.origin_input_ids, 1)[0]


def test_chunked_prefill_with_cached_prefix() -> None:
    sched, runner, kv = make_scheduler(chunked_prefill_size=8)
    p = prompt(5, 12)
    a = submit(sched, "a", p, 2)
    assert_exact(drain(sched), [a])
    n0 = len(runner.batches)
    b = submit(sched, "b", p + prompt(6, 18), 3)  # 12 cached (+1 output), 18 new
    outs = drain(sched)
    assert_exact(outs, [b])
    assert finals(outs)["b"].cached_tokens == 12
    assert [x.extend_seq_lens for x in runner.batches[n0:n0 + 3]] == [[8], [8], [2]]
    assert [x.extend_prefix_lens for x in runner.batches[n0:n0 + 3]] == [[12], [20], [28]]


def test_page_size_4() -> None:
    sched, runner, kv = make_scheduler(page_size=4, chunked_prefill_size=8)
    p = prompt(7, 22)
    a = submit(sched, "a", p, 5)
    assert_exact(drain(sched), [a])
    assert kv.tree_cache.evictable_size() == 24  # 26 computed tokens, cut to whole pages
    b = submit(sched, "b", p + [501, 502, 503, 504, 505, 506, 507, 508], 5)
    c = submit(sched, "c", p, 5)
    outs = drain(sched)
    assert_exact(outs, [b, c])
    fin = finals(outs)
    assert fin["b"].cached_tokens == 20  # 22 shared tokens, floored to 5 pages
    assert fin["c"].cached_tokens == 20  # 21 matchable, floored
    # Chunks, like matches, are whole pages.
    assert all(n % 4 == 0 for b_ in runner.batches if not b_.is_decode_only for n in b_.extend_prefix_lens)
    reqs = [submit(sched, f"r{i}", prompt(50 + i, 5 + 3 * i), 3 + i) for i in range(6)]
    assert_exact(drain(sched), reqs)


def test_pages_are_budgeted_whole_in_one_prefill_batch() -> None:
    sched, runner, kv = make_scheduler(pool_tokens=32, page_size=8)  # 4 pages
    a = submit(sched, "a", prompt(9, 17), 2)  # 3 pages
    b = submit(sched, "b", prompt(10, 9), 2)  # 2 pages: must wait for a, not overrun the pool
    outs = drain(sched)
    assert_exact(outs, [a, b])
    assert [x.extend_seq_lens for x in runner.batches] == [[17], [1], [9], [1]]


def test_flush_cache_only_when_idle() -> None:
    sched, runner, kv = make_scheduler()
    a = submit(sched, "a", prompt(11, 10), 3)
    assert sched.flush_cache() is False
    assert_exact(drain(sched), [a])
    assert kv.tree_cache.evictable_size() == 12
    assert sched.flush_cache() is True
    assert kv.tree_cache.total_size() == 0 and kv.available_size() == kv.total_tokens
    b = submit(sched, "b", prompt(11, 10), 3)
    outs = drain(sched)
    assert_exact(outs, [b])
    assert finals(outs)["b"].cached_tokens == 0


def test_without_radix_cache() -> None:
    sched, runner, kv = make_scheduler(radix=False)
    assert isinstance(kv.tree_cache, ChunkCache)
    p = prompt(8, 12)
    reqs = [submit(sched, "a", p, 4), submit(sched, "b", p + [1], 4)]
    outs = drain(sched)
    assert_exact(outs, reqs)
    c = submit(sched, "c", p, 4)
    outs2 = drain(sched)
    assert_exact(outs2, [c])
    assert all(o.cached_tokens == 0 for o in outs + outs2)
    assert kv.available_size() == kv.total_tokens


# --- streaming and non-streaming outputs ---------------------------------------------------


def test_non_streaming_request_sends_its_first_token_and_its_finish_only() -> None:
    sched, runner, kv = make_scheduler()
    a = Req("a", prompt(40, 6), SamplingParams(max_new_tokens=6), stream=False)
    sched.add_request(a)
    b = submit(sched, "b", prompt(41, 6), 6)  # streams (the default)
    want = expected_tokens(a.origin_input_ids, 6)
    c = Req("c", prompt(40, 6), SamplingParams(max_new_tokens=6, stop_token_ids=[want[3]]), stream=False)
    sched.add_request(c)
    outs = drain(sched)
    assert [len(o.new_token_ids) for o in outs if o.rid == "a"] == [1, 5]
    assert [len(o.new_token_ids) for o in outs if o.rid == "b"] == [1] * 6
    assert [len(o.new_token_ids) for o in outs if o.rid == "c"] == [1, 3]  # stopped at its 4th token
    got, fin = tokens(outs), finals(outs)
    assert got["a"] == want and fin["a"].finished_reason == FINISH_LENGTH(6) and fin["a"].completion_tokens == 6
    assert got["b"] == expected_tokens(b.origin_input_ids, 6)
    assert got["c"] == want[:4] and fin["c"].finished_reason == FINISH_STOP(want[3])


def test_forward_batch_per_request_lists_follow_the_batch() -> None:
    """The sampling lists and pool rows are reused between decode steps: a change of the batch's
    requests, even in place (a merge, a removal), must rebuild them."""

    def req(rid: str, temperature: float, row: int) -> Req:
        r = Req(rid, [1, 2, 3], SamplingParams(temperature=temperature))
        r.output_ids, r.req_pool_idx = [7 + row], row
        return r

    a, b, c = req("a", 0.0, 1), req("b", 0.5, 2), req("c", 1.0, 3)
    batch = ScheduleBatch([a, b], ForwardMode.DECODE)

    def forward_batch() -> ForwardBatch:
        n = len(batch.reqs)
        batch.prefix_lens, batch.extend_lens, batch.out_slots = [3] * n, [1] * n, list(range(10, 10 + n))
        return batch.to_forward_batch()

    assert forward_batch().sampling.temperatures == [0.0, 0.5]
    batch.reqs.append(c)
    fb = forward_batch()
    assert fb.sampling.temperatures == [0.0, 0.5, 1.0] and fb.req_pool_indices.tolist() == [1, 2, 3]
    batch.reqs.remove(a)
    fb = forward_batch()
    assert fb.sampling.temperatures == [0.5, 1.0] and fb.req_pool_indices.tolist() == [2, 3]
    assert fb.input_ids.tolist() == [9, 10] and fb.positions.tolist() == [3, 3] and fb.seq_lens.tolist() == [4, 4]
    assert fb.sampling.steps == [1, 1]


# --- stop conditions -------------------------------------------------------------------------


def test_eos_stop() -> None:
    sched, runner, kv = make_scheduler()
    p = prompt(60, 6)
    exp = expected_tokens(p, 10)
    assert exp[2] not in exp[:2] and exp[0] != exp[1]
    submit(sched, "r", p, 10, eos=(exp[2],))
    outs = drain(sched)
    assert tokens(outs)["r"] == exp[:3]
    assert finals(outs)["r"].finished_reason == FINISH_STOP(exp[2])
    # The scheduler's EOS ids apply to requests that bring none.
    sched.intake.eos_token_ids = frozenset((exp[1],))
    r2 = submit(sched, "r2", p, 10)
    drain(sched)
    assert r2.output_ids == exp[:2] and r2.finished_reason == FINISH_STOP(exp[1])


def test_ignore_eos_and_stop_token_ids() -> None:
    sched, runner, kv = make_scheduler()
    p = prompt(61, 6)
    exp = expected_tokens(p, 10)
    assert len(set(exp[:4])) == 4
    ign = submit(sched, "ign", p, 10, eos=(exp[2],), ignore_eos=True)
    stp = submit(sched, "stp", p, 10, stop_token_ids=[exp[3]])
    both = submit(sched, "both", p, 10, eos=(exp[1],), ignore_eos=True, stop_token_ids=[exp[3]])
    drain(sched)
    assert ign.output_ids == exp and ign.finished_reason == FINISH_LENGTH(10)
    assert stp.output_ids == exp[:4] and stp.finished_reason == FINISH_STOP(exp[3])
    assert both.output_ids == exp[:4] and both.finished_reason == FINISH_STOP(exp[3])


def test_stop_strings_via_detokenize() -> None:
    sched, runner, kv = make_scheduler()
    p = prompt(62, 6)
    exp = expected_tokens(p, 10)
    assert exp[3] not in exp[:3]
    stop = f"<{exp[3]}>"
    no_detok = submit(sched, "nd", p, 10, stop=[stop])
    drain(sched)
    assert no_detok.output_ids == exp  # without a detokenizer stop strings cannot match here
    sched.outputs.detokenize = lambda ids: "".join(f"<{t}>" for t in ids)
    submit(sched, "r", p, 10, stop=["never", stop])
    outs = drain(sched)
    assert tokens(outs)["r"] == exp[:4]
    assert finals(outs)["r"].finished_reason == FINISH_STOP(stop)
    # A stop string spanning two tokens.
    span = f"{exp[4]}><{exp[5]}"
    r2 = submit(sched, "r2", p, 10, stop=[span])
    drain(sched)
    assert r2.output_ids == exp[:6]


# --- a randomized soak: many configurations, exact outputs, the invariant at every idle ------


@pytest.mark.parametrize("seed", range(12))
def test_random_workloads_stay_exact(seed: int) -> None:
    rng = random.Random(seed)
    page = rng.choice([1, 1, 2, 4])
    radix = rng.random() < 0.8
    chunk = rng.choice([-1, 8, 16]) if page <= 4 else -1
    pool = page * rng.randint(24, 64)
    sched, runner, kv = make_scheduler(
        pool_tokens=pool, page_size=page, radix=radix, chunked_prefill_size=chunk,
        max_running_requests=rng.choice([None, 2, 5]), clip_max_new_tokens=rng.choice([2, 8, 4096]),
        max_prefill_tokens=rng.choice([16, 16384]),
    )
    bases = [prompt(1000 * seed + i, rng.randint(4, 16)) for i in range(3)]
    live: list[Req] = []
    aborted: set[str] = set()
    outs: list[OutRow] = []
    for i in range(14):
        p = rng.choice(bases)[: rng.randint(1, 16)] + prompt(10_000 * seed + i, rng.randint(0, 6))
        max_new = rng.randint(1, 10)
        if len(p) + max_new >= pool:
            continue
        live.append(submit(sched, f"r{i}", p, max_new))
        for _ in range(rng.randint(0, 3)):
            outs.extend(sched.step())
        if rng.random() < 0.1:
            victim = rng.choice(live)
            if sched.abort_request(victim.rid):
                aborted.add(victim.rid)
    outs.extend(drain(sched))
    got, fin = tokens(outs), finals(outs)
    assert set(fin) == {r.rid for r in live}
    for r in live:
        exp = expected_tokens(r.origin_input_ids, r.max_new_tokens)
        if r.rid in aborted:
            assert isinstance(fin[r.rid].finished_reason, FINISH_ABORT)
            assert got[r.rid] == exp[: len(got[r.rid])]
        else:
            assert got[r.rid] == exp, (seed, r.rid)
    assert max(b.batch_size for b in runner.batches) <= sched.queues.max_running_requests


def test_batch_columns_follow_every_change_of_the_requests() -> None:
    """The per-request columns follow ``extend`` and ``drop_finished`` without a rebuild and are
    rebuilt after any other change; whatever the sequence, they equal columns built afresh, and a
    snapshot of the batch keeps its own."""
    from radixserve.sched.schedule_batch import build_columns

    rng = random.Random(3)
    counter = iter(range(10**6))

    def new() -> Req:
        i = next(counter)
        r = Req(f"r{i}", [1] * rng.randint(1, 9), SamplingParams(temperature=rng.random(),
                                                                  frequency_penalty=rng.choice([0.0, 0.5])),
                stream=rng.random() < 0.8)
        r.req_pool_idx, r.cached_tokens, r.queue_time = i, rng.randint(0, 5), rng.random()
        return r

    batch = ScheduleBatch([new() for _ in range(20)])
    for _ in range(400):
        op = rng.randrange(5)
        if op == 0:
            batch.extend([new() for _ in range(rng.randint(0, 4))])
        elif op == 1:
            for r in rng.sample(batch.reqs, min(len(batch.reqs), rng.randint(0, 3))):
                r.finished_reason = FINISH_LENGTH(1)
            batch.drop_finished()
        elif op == 2 and batch.reqs:  # a retraction: popped in place
            batch.reqs.pop(rng.randrange(len(batch.reqs)))
        elif op == 3:
            snap = batch.snapshot()
            before = [list(c) for c in snap.columns.get(snap.reqs)]
            batch.extend([new()])
            batch.drop_finished()
            assert snap.columns.get(snap.reqs) == before
        assert batch.columns.get(batch.reqs) == build_columns(batch.reqs)
