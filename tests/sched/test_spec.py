"""Speculative decoding's scheduler side (``sched/spec.py``) driven by deterministic runners: the
outputs equal decoding without drafts under both builders, paged and unpaged KV, with and without
the radix cache and under KV pressure; stops part-way through the kept tokens; rejected drafts'
KV is given back at once (``KVManager.truncate``) and never cached; requests whose outputs drafts
could change do not draft. Every drain checks the KV invariant."""

from __future__ import annotations

import pytest

from radixserve.config.scheduling import SCHEDULE_POLICIES
from radixserve.mem.forward_batch import ForwardBatch, ForwardOutput
from radixserve.mem.kv_pool import ReqToTokenPool
from radixserve.sched.core import SchedulerCore
from radixserve.sched.finish import FINISH_LENGTH, FINISH_STOP
from radixserve.sched.kv_manager import KVManager
from radixserve.sched.req import Req
from radixserve.sched.sampling_params import SamplingParams
from radixserve.server.scheduler.dashboard_state import rank_snapshot
from tests.fakes import VOCAB, EchoRunner, drain, make_scheduler
from tests.sched.sched_helpers import enter, finals, prompt, submit, tokens

CYCLE = 23


class CycleRunner(EchoRunner):
    """Next token = a fixed function of the last token alone, cycling through ``CYCLE`` tokens: once
    a request's tokens went round the cycle, its n-gram drafts are all right."""

    def next_token(self, token: int, position: int) -> int:
        return (token * 5 + 1) % CYCLE + 1


class CheckingRunner(CycleRunner):
    """Also checks between forwards what the scheduler promises: every request in the step holds
    KV for exactly its tokens before the step (the last one's is this step's to write), plus this
    step's; nothing of a rejected draft is left over; and the "KV" (here: the token and position
    each slot was written with) of every position before the step is that position's token, also
    where a draft tree's kept path moved its slots."""

    def __init__(self, pool: ReqToTokenPool | None = None) -> None:
        super().__init__(pool)
        self.sched = None
        self.spec_rows = 0
        self.written: dict[int, tuple[int, int]] = {}  # slot -> (token, position) of its last write

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        if self.sched is not None:
            by_row = {r.req_pool_idx: r for r in self.sched.queues.by_rid.values()}
            for i, (row, start, n) in enumerate(zip(batch.req_pool_indices.tolist(), batch.extend_prefix_lens,
                                                    batch.extend_seq_lens, strict=True)):
                req = by_row[row]
                assert len(req.kv_indices) == start + n, (req.rid, len(req.kv_indices), start, n)
                if batch.verify is not None and i in batch.verify.rows:
                    assert start == req.num_tokens - 1
                    self.spec_rows += 1
                have = (req.origin_input_ids + req.output_ids)[:start]
                assert [self.written.get(s) for s in req.kv_indices[:start]] == [(t, q) for q, t in enumerate(have)]
        self.written.update(zip(batch.out_cache_loc.tolist(),
                                zip(batch.input_ids.tolist(), batch.positions.tolist(), strict=True), strict=True))
        return super().forward(batch)


def cheap_drafts(sched) -> None:
    """Step costs that grow slowly with tokens, instead of the fake runners' microseconds of noise:
    drafting pays whenever acceptance is not tiny."""
    spec = sched.parts.spec
    if spec is not None:
        spec.costs.seconds = {n: 1.0 + 0.01 * n for n in range(1, 300)}
        spec.observe = lambda tokens, seconds: None


def cycle_prompt(start: int, n: int) -> list[int]:
    """A prompt that follows ``CycleRunner``'s rule: its outputs continue the cycle it is on."""
    out = [start]
    for _ in range(n - 1):
        out.append((out[-1] * 5 + 1) % CYCLE + 1)
    return out


def drain_loop(sched: SchedulerCore) -> list:
    """``drain``, by the overlap loop where the options ask for it (``overlap_schedule="on"``)."""
    if sched.settings.args.overlap_schedule != "on":
        return drain(sched)
    outs: list = []
    for _ in range(10000):
        outs.extend(sched.step_overlapped())
        if not sched.has_work() and sched.forward.in_flight is None:
            outs.extend(sched.step_overlapped())  # the idle step's self-check
            sched.kv.check_invariant()
            return outs
    raise AssertionError("scheduler did not drain")


def run(runner: type[EchoRunner], prompts: list[list[int]], max_new: int, spec: bool, **kw: object):
    args = dict(kw)
    pool = args.pop("pool_tokens", 512)
    if spec:
        args.setdefault("speculative_algorithm", "ngram")
        args.setdefault("speculative_num_draft_tokens", 6)
    sched, model, kv = make_scheduler(pool_tokens=pool, runner=runner, **args)  # type: ignore[arg-type]
    cheap_drafts(sched)
    if isinstance(model, CheckingRunner):
        model.sched = sched  # type: ignore[assignment]
    reqs = [submit(sched, f"r{i}", p, max_new) for i, p in enumerate(prompts)]
    outs = drain_loop(sched)
    return sched, model, reqs, outs


@pytest.mark.parametrize("kw", [
    {},
    {"page_size": 4},
    {"radix": False},
    {"scheduler": "unified"},
    {"scheduler": "unified", "page_size": 4},
    {"overlap_schedule": "on"},
    {"enable_mixed_chunk": True, "chunked_prefill_size": 16},
])
def test_greedy_outputs_equal_plain_decoding(kw: dict) -> None:
    prompts = [cycle_prompt(3, 30), cycle_prompt(7, 5) + prompt(1, 10), prompt(2, 40)]
    _, _, _, plain = run(CycleRunner, prompts, 40, False, **kw)
    sched, model, reqs, outs = run(CheckingRunner, prompts, 40, True, **kw)
    assert tokens(outs) == tokens(plain)
    assert {r: o.finished_reason for r, o in finals(outs).items()} == {r: FINISH_LENGTH(40) for r in ("r0", "r1", "r2")}
    assert model.spec_rows > 0
    # r0's prompt is on the cycle: its drafts are right from the start, most of its tokens are drafts
    assert reqs[0].spec_accepted_tokens >= 25
    # r2's random prompt says nothing of its outputs: its drafts start once its output went round the cycle
    assert reqs[2].spec_accepted_tokens > 0


@pytest.mark.parametrize("policy", SCHEDULE_POLICIES)
def test_every_schedule_policy_keeps_outputs(policy: str) -> None:
    """Prompts that share a prefix (what lpm and dfs-weight order by) and more requests than run at
    once: each policy's order, with drafts, gives every request the tokens it gets without."""
    base = cycle_prompt(3, 12)
    prompts = [base + prompt(i, 6) for i in range(3)] + [cycle_prompt(i + 5, 20) for i in range(3)]
    kw = {"schedule_policy": policy, "max_running_requests": 3}
    _, _, _, plain = run(CycleRunner, prompts, 24, False, **kw)
    sched, model, _, outs = run(CheckingRunner, prompts, 24, True, **kw)
    assert tokens(outs) == tokens(plain)
    assert model.spec_rows > 0


def test_priority_preemption_with_drafts() -> None:
    """A more important request arriving while the batch is full preempts a drafting one; every
    request still ends with its plain tokens and the memory invariant holds (``drain`` checks it)."""
    outputs = []
    for spec in (False, True):
        kw: dict = {"enable_priority_scheduling": True, "max_running_requests": 2}
        if spec:
            kw.update(speculative_algorithm="ngram", speculative_num_draft_tokens=6)
        sched, model, _ = make_scheduler(pool_tokens=512, runner=CheckingRunner if spec else CycleRunner, **kw)
        cheap_drafts(sched)
        model.sched = sched  # type: ignore[attr-defined]
        reqs = [Req(f"low{i}", cycle_prompt(i + 2, 20), SamplingParams(max_new_tokens=30), priority=0) for i in range(2)]
        for r in reqs:
            enter(sched, r)
        for _ in range(4):
            sched.step()
        reqs.append(Req("high", cycle_prompt(9, 20), SamplingParams(max_new_tokens=10), priority=100))
        enter(sched, reqs[-1])
        drain(sched)
        outputs.append([r.output_ids for r in reqs])
        if spec:
            assert sched.stats.num_preemptions > 0 and sched.parts.spec.stats.verify_steps > 0
    assert outputs[1] == outputs[0] and [len(o) for o in outputs[0]] == [30, 30, 10]


@pytest.mark.parametrize("kw", [{}, {"scheduler": "unified"}, {"overlap_schedule": "on"}, {"page_size": 4}])
def test_draft_tree_keeps_the_branch_the_model_takes(kw: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first output's last two tokens occurred twice before: latest followed by a junk token,
    earlier by what the model says next. A chain drafts the junk; a tree also drafts the earlier
    continuation and keeps it, its KV slots moved to the positions it is kept at (the runner checks
    every position's KV each step); outputs equal plain decoding's, and a repeat hits the cache."""
    c = cycle_prompt(3, 12)
    p = [*c, 99, c[4], c[5], 500, 7, c[4]]  # the model's first token: c[5]
    _, _, _, plain = run(CycleRunner, [p], 12, False, **kw)
    moved: list[list[int]] = []
    keep_path = KVManager.keep_path
    monkeypatch.setattr(KVManager, "keep_path", lambda kv, req, first, path: (moved.append(path),
                                                                              keep_path(kv, req, first, path)))
    sched, model, reqs, outs = run(CheckingRunner, [p], 12, True, speculative_ngram_max_bfs_breadth=2, **kw)
    assert tokens(outs) == tokens(plain)
    trees = kw.get("page_size", 1) == 1  # trees move slots: page size 1 only, chains otherwise
    assert bool(moved) == trees and all(path[0] > 0 for path in moved)
    again = submit(sched, "again", p + tokens(outs)["r0"], 1)
    ps = kw.get("page_size", 1)  # (the cache matches whole pages)
    assert finals(drain(sched))["again"].cached_tokens == (len(again.origin_input_ids) - 1) // ps * ps


def test_echo_runner_drafts_are_rejected_and_outputs_still_equal() -> None:
    """EchoRunner's tokens depend on the position: drafts from the prompt are mostly wrong."""
    prompts = [prompt(5, 20) * 2, prompt(6, 8)]
    _, _, _, plain = run(EchoRunner, prompts, 30, False)
    sched, _, _, outs = run(EchoRunner, prompts, 30, True)
    assert tokens(outs) == tokens(plain)
    s = sched.parts.spec.stats
    assert s.draft_tokens > s.accepted_tokens


@pytest.mark.parametrize("max_new", [1, 2, 5, 9, 13])
def test_max_new_tokens_part_way_through_kept_tokens(max_new: int) -> None:
    sched, _, reqs, outs = run(CheckingRunner, [cycle_prompt(4, 40)], max_new, True)
    assert len(tokens(outs)["r0"]) == max_new
    assert finals(outs)["r0"].finished_reason == FINISH_LENGTH(max_new)


def test_stop_token_inside_the_kept_tokens() -> None:
    p = cycle_prompt(4, 40)
    _, _, _, plain = run(CycleRunner, [p], 30, False)
    stop = tokens(plain)["r0"][6]
    first = tokens(plain)["r0"].index(stop)
    sched, model, kv = make_scheduler(runner=CycleRunner, speculative_algorithm="ngram")
    cheap_drafts(sched)
    submit(sched, "r0", p, 30, stop_token_ids=[stop])
    outs = drain(sched)
    assert tokens(outs)["r0"] == tokens(plain)["r0"][: first + 1]
    assert finals(outs)["r0"].finished_reason == FINISH_STOP(stop)
    # what the cache keeps is the request's tokens, not a rejected draft: a repeat hits all but the last
    again = submit(sched, "again", p + tokens(outs)["r0"], 1)
    outs2 = drain(sched)
    assert finals(outs2)["again"].cached_tokens == len(again.origin_input_ids) - 1


@pytest.mark.parametrize("scheduler", ["prefill_first", "unified"])
def test_under_kv_pressure_outputs_equal(scheduler: str) -> None:
    """A pool too small for everyone: retraction or preemption happens with speculation on too,
    and drafts only take what is left."""
    kw = {} if scheduler == "prefill_first" else {"scheduler": "unified"}
    prompts = [cycle_prompt(i + 2, 24) for i in range(4)]
    _, _, _, plain = run(CycleRunner, prompts, 40, False, pool_tokens=160, **kw)
    sched, _, _, outs = run(CheckingRunner, prompts, 40, True, pool_tokens=160, **kw)
    assert tokens(outs) == tokens(plain)


def test_overlap_builds_ahead_while_the_batch_is_too_large_to_draft() -> None:
    """Under the overlap loop a batch larger than --speculative-max-batch-size is scheduled a step
    ahead as without speculation; once requests finish and it is small enough to draft, each step
    runs in the normal order. Outputs equal plain decoding's throughout."""
    prompts = [cycle_prompt(i + 2, 30) for i in range(6)]
    lengths = [8, 10, 12, 40, 40, 40]
    kw = {"overlap_schedule": "on", "speculative_max_batch_size": 3}

    def go(spec: bool) -> tuple[SchedulerCore, list[list[int]], list[tuple[int, bool, bool]]]:
        args = dict(kw, speculative_algorithm="ngram", speculative_num_draft_tokens=6) if spec else dict(kw)
        sched, model, _ = make_scheduler(pool_tokens=1024, runner=CycleRunner, **args)
        cheap_drafts(sched)
        model.sched = sched  # type: ignore[attr-defined]
        seen: list[tuple[int, bool, bool]] = []
        decide = sched.can_build_ahead

        def record(running):  # type: ignore[no-untyped-def]
            ok = decide(running)
            seen.append((len(running.batch.reqs), running.batch.drafts is not None, ok))
            return ok

        sched.can_build_ahead = record  # type: ignore[method-assign]
        reqs = [submit(sched, f"r{i}", p, n) for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))]
        drain_loop(sched)
        return sched, [r.output_ids for r in reqs], seen

    _, plain, _ = go(False)
    sched, got, seen = go(True)
    assert got == plain
    assert any(ok for n, _, ok in seen if n > 3), seen  # built ahead while large
    assert not any(ok for _, drafted, ok in seen if drafted)  # never after a step with drafts
    assert sched.parts.spec.stats.verify_steps > 0


def test_prompt_logprobs_first_then_drafts() -> None:
    """A request that wants its prompt's logprobs gets them from the step that samples its first
    token, which has no drafts; then it drafts like any other, as do requests with penalties or
    logprobs (both applied at every verified position by the runner)."""
    sched, model, kv = make_scheduler(runner=CheckingRunner, speculative_algorithm="ngram")
    cheap_drafts(sched)
    model.sched = sched  # type: ignore[attr-defined]
    p = cycle_prompt(5, 40)
    pen = submit(sched, "pen", p, 20, frequency_penalty=0.5)
    lp = submit(sched, "lp", p, 20, logprobs=True)
    plp = Req("plp", p, SamplingParams(max_new_tokens=20))
    plp.want_input_logprobs(10)
    enter(sched, plp)
    drain(sched)
    assert pen.spec_verify_ct > 0 and lp.spec_verify_ct > 0 and plp.spec_verify_ct > 0
    assert len(plp.input_logprobs) == len(p) - 10


def test_large_batches_do_not_draft() -> None:
    prompts = [cycle_prompt(i + 2, 30) for i in range(6)]
    sched, _, _, _ = run(CycleRunner, prompts, 20, True, speculative_max_batch_size=4)
    assert sched.parts.spec.stats.verify_steps == 0


def test_meta_counts_per_request() -> None:
    sched, _, reqs, outs = run(CycleRunner, [cycle_prompt(3, 30)], 30, True)
    r = reqs[0]
    assert r.spec_verify_ct > 0 and r.spec_accepted_tokens > 0
    assert r.spec_accepted_tokens + sched.stats.decode_steps + 1 >= 30  # 1 from the prefill
    fin = finals(outs)["r0"]
    assert fin.spec == (r.spec_verify_ct, r.spec_accepted_tokens)
    # the dashboard's figures are the scheduler's counters
    shown = rank_snapshot(sched)["spec"]
    st = sched.parts.spec.stats
    assert shown["algorithm"] == "ngram" and shown["num_draft_tokens"] == 6
    assert (shown["verify_steps"], shown["draft_tokens"], shown["accepted_tokens"]) == \
        (st.verify_steps, st.draft_tokens, st.accepted_tokens)
    assert shown["accept_rate"] == st.accepted_tokens / st.draft_tokens
    assert len(shown["class_acceptance"]) == 3
    assert rank_snapshot(run(CycleRunner, [cycle_prompt(3, 30)], 4, False)[0])["spec"] is None


def test_vocab_is_what_runners_use() -> None:
    assert all(1 <= CycleRunner().next_token(t, 0) <= CYCLE for t in range(VOCAB))


# --- drafts made by the runner (a draft model) ---------------------------------------------------

class DraftingRunner(CheckingRunner):
    """Makes the drafts it is asked for (``VerifyRows.by_runner``) as a draft model would: the cycle's
    next tokens, except every third draft, which is wrong."""

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        v = batch.verify
        if v is not None:
            assert v.by_runner and all(t == -1 for d in v.drafts for t in d)
            starts = [sum(batch.extend_seq_lens[:r]) for r in v.rows]
            for i, f in enumerate(starts):
                tok, d = int(batch.input_ids[f]), []
                for j in range(len(v.drafts[i])):
                    tok = self.next_token(tok, 0) if (f + j) % 3 else (tok % (VOCAB - 2)) + 2
                    d.append(tok)
                    batch.input_ids[f + 1 + j] = tok
                v.drafts[i] = d
        out = super().forward(batch)
        if v is not None:
            out.drafts = v.drafts
        return out


@pytest.mark.parametrize("kw", [{}, {"scheduler": "unified", "page_size": 4}])
def test_runner_made_drafts_keep_outputs_exact(kw: dict) -> None:
    prompts = [cycle_prompt(3, 12), prompt(2, 20)]
    _, _, _, plain = run(CycleRunner, prompts, 40, False, **kw)
    sched, model, reqs, outs = run(DraftingRunner, prompts, 40, True, speculative_algorithm="draft", **kw)
    assert tokens(outs) == tokens(plain)
    s = sched.parts.spec.stats
    assert s.verify_steps > 0 and 0 < s.accepted_tokens < s.draft_tokens
