"""Sampling penalties in the batched sampler: exact logits, the no-penalty fast path, how a request's
penalties reach the sampler (ScheduleBatch hands each request's history), and validation."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from radixserve.mem.forward_batch import SamplingBatchInfo
from radixserve.mem.penalties import RowPenalties
from radixserve.model.sampler import Sampler, apply_penalties
from radixserve.sched.req import Req
from radixserve.sched.sampling_params import InvalidRequest, SamplingParams
from radixserve.sched.schedule_batch import ForwardMode, ScheduleBatch

V = 16


def logits_of(*rows: list[float]) -> torch.Tensor:
    return torch.tensor([r + [0.0] * (V - len(r)) for r in rows], dtype=torch.float32)


def greedy_info(n: int, penalties: list[RowPenalties | None] | None, steps: list[int] | None = None,
                input_ids: torch.Tensor | None = None) -> SamplingBatchInfo:
    info = SamplingBatchInfo.greedy(n)
    info.penalties = penalties
    info.input_ids = input_ids
    if steps is not None:
        info.steps = steps
    return info


def row(out: list[int], **kw: Any) -> RowPenalties:
    return RowPenalties(output_ids=out, n_out=len(out), **kw)


# --- exact logits -----------------------------------------------------------------------------------
def test_frequency_and_presence_exact() -> None:
    logits = logits_of([1.0, -1.0, 2.0, -2.0, 0.5])
    out = apply_penalties(logits, greedy_info(1, [row([0, 0, 1, 3, 0], frequency=0.5, presence=0.25)]))
    want = logits.clone()
    want[0, 0] -= 0.5 * 3 + 0.25
    want[0, 1] -= 0.5 * 1 + 0.25
    want[0, 3] -= 0.5 * 1 + 0.25
    assert torch.equal(out, want)
    assert logits[0, 0] == 1.0  # the model's logits are not touched (logprobs come from them)


def test_negative_penalties_encourage() -> None:
    logits = logits_of([1.0, 1.0])
    out = apply_penalties(logits, greedy_info(1, [row([1, 1], frequency=-2.0, presence=-1.0)]))
    assert out[0, 1].item() == 1.0 + 2.0 * 2 + 1.0 and out[0, 0].item() == 1.0


def test_repetition_divides_positive_multiplies_negative() -> None:
    logits = logits_of([3.0, -3.0, 3.0, -3.0, 0.0])
    out = apply_penalties(logits, greedy_info(1, [row([0, 1, 1, 4], repetition=1.5)]))
    assert out[0].tolist()[:5] == [2.0, -4.5, 3.0, -3.0, 0.0]
    # below 1 it rewards repeats the same way round
    out = apply_penalties(logits, greedy_info(1, [row([0, 1], repetition=0.5)]))
    assert out[0].tolist()[:2] == [6.0, -1.5]


def test_repetition_then_frequency_order() -> None:
    logits = logits_of([4.0])
    out = apply_penalties(logits, greedy_info(1, [row([0, 0], repetition=2.0, frequency=1.0, presence=0.5)]))
    assert out[0, 0].item() == 4.0 / 2.0 - 2 * 1.0 - 0.5


def test_logit_bias_exact_and_clamped_to_vocab() -> None:
    logits = logits_of([1.0, 2.0, 3.0])
    out = apply_penalties(logits, greedy_info(1, [row([], logit_bias={0: 100.0, 2: -100.0, V + 5: 1.0})]))
    want = logits.clone()
    want[0, 0] += 100.0
    want[0, 2] -= 100.0
    assert torch.equal(out, want)
    assert Sampler(0).sample(logits, greedy_info(1, [row([], logit_bias={5: 50.0})])).next_token_ids == [5]


def test_min_new_tokens_masks_finish_tokens_until_reached() -> None:
    logits = logits_of([0.0, 0.0, 9.0, 8.0])
    pen = row([7, 7], min_new_tokens=3, finish_ids=(2, 3))
    out = apply_penalties(logits, greedy_info(1, [pen], steps=[2]))
    assert out[0, 2].item() == -math.inf and out[0, 3].item() == -math.inf
    assert out[0, 0].item() == 0.0
    assert Sampler(0).sample(logits, greedy_info(1, [pen], steps=[2])).next_token_ids != [2]
    # three generated: the finish tokens are free again
    pen3 = row([7, 7, 7], min_new_tokens=3, finish_ids=(2, 3))
    assert torch.equal(apply_penalties(logits, greedy_info(1, [pen3], steps=[3])), logits)


def test_rows_without_penalties_are_bit_exact_in_a_mixed_batch() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, V, generator=g) * 3
    pens: list[RowPenalties | None] = [None, row([1, 2, 2], frequency=1.0, repetition=1.3), None,
                                       row([], logit_bias={3: 5.0})]
    out = apply_penalties(logits, greedy_info(4, pens))
    for i in (0, 2):
        assert torch.equal(out[i], logits[i])
    assert not torch.equal(out[1], logits[1]) and not torch.equal(out[3], logits[3])
    # the same rows alone give the same result (no cross-row effect)
    alone = apply_penalties(logits[1:2], greedy_info(1, [pens[1]]))
    assert torch.equal(alone[0], out[1])


def test_fast_path_returns_the_logits_untouched() -> None:
    logits = torch.randn(3, V)
    assert apply_penalties(logits, greedy_info(3, None)) is logits
    assert apply_penalties(logits, greedy_info(3, [None, None, None])) is logits
    a = Sampler(0).sample(logits, greedy_info(3, None))
    b = Sampler(0).sample(logits, greedy_info(3, [None, None, None]))
    assert a.next_token_ids == b.next_token_ids == logits.argmax(-1).tolist()


def test_pending_token_counts_from_input_ids() -> None:
    """The overlap loop: the token sampled by the forward before is in the forward's input ids, not
    yet in output_ids; it counts."""
    logits = logits_of([5.0, 5.0, 5.0])
    pen = row([0], frequency=1.0, pending_pos=2)
    input_ids = torch.tensor([9, 9, 1])
    out = apply_penalties(logits, greedy_info(1, [pen], input_ids=input_ids))
    assert out[0].tolist()[:3] == [4.0, 4.0, 5.0]


def test_logprobs_come_from_the_unpenalized_logits() -> None:
    logits = logits_of([2.0, 1.0])
    info = greedy_info(1, [row([], logit_bias={1: 10.0})])
    info.return_logprob = [True]
    out = Sampler(0).sample(logits, info)
    assert out.next_token_ids == [1]
    assert out.logprobs is not None
    assert out.logprobs[0] == pytest.approx(torch.log_softmax(logits, -1)[0, 1].item())


def test_sampled_rows_use_penalized_logits() -> None:
    logits = logits_of([10.0, 0.0])
    info = SamplingBatchInfo([1.0], [1.0], [-1], [0.0], [None], [0],
                             penalties=[row([], logit_bias={0: -100.0, 1: 100.0})])
    s = Sampler(0)
    assert {s.sample(logits, info).next_token_ids[0] for _ in range(20)} == {1}


# --- how penalties reach the sampler ---------------------------------------------------------------
def _batch(reqs: list[Req], mode: ForwardMode, prefix: list[int], extend: list[int]) -> ScheduleBatch:
    b = ScheduleBatch(reqs, mode)
    b.prefix_lens, b.extend_lens, b.out_slots = prefix, extend, list(range(sum(extend)))
    return b


def test_schedule_batch_hands_each_penalized_request_its_history() -> None:
    plain = Req("plain", [1, 2], SamplingParams(max_new_tokens=8))
    pen = Req("pen", [1, 2], SamplingParams(max_new_tokens=8, frequency_penalty=1.0, min_new_tokens=2),
              eos_token_ids=(3,))
    plain.req_pool_idx, pen.req_pool_idx = 0, 1
    pen.output_ids = [5, 6]
    # a MIXED step: plain's prompt (2 tokens), pen's decode (its last output is the input)
    fb = _batch([plain, pen], ForwardMode.MIXED, [0, 3], [2, 1]).to_forward_batch()
    rows = fb.sampling.penalties
    assert rows is not None and rows[0] is None
    r = rows[1]
    assert r is not None and r.frequency == 1.0 and list(r.output_ids[: r.n_out]) == [5, 6]
    assert r.pending_pos == -1 and r.finish_ids == (3,)
    assert fb.sampling.input_ids is fb.input_ids
    # the overlap loop: pen's input is the placeholder of the token the running forward samples;
    # it is part of the history, read from the forward's input ids once resolved
    fb = _batch([plain, pen], ForwardMode.MIXED, [0, 3], [2, 1]).to_forward_batch(pending={id(pen): 0})
    rows = fb.sampling.penalties
    assert rows is not None and rows[1] is not None and rows[1].pending_pos == 2
    assert fb.input_ids.tolist() == [1, 2, -1] and fb.sampling.steps == [0, 3]
    fb = _batch([plain, pen], ForwardMode.DECODE, [3, 3], [1, 1])
    plain.output_ids = [9]
    rows = fb.to_forward_batch(pending={id(pen): 1}).sampling.penalties
    assert rows is not None and rows[0] is None and rows[1] is not None and rows[1].pending_pos == 1
    # no penalized request in the batch: nothing attached (the sampler's fast path)
    fb = _batch([plain], ForwardMode.DECODE, [3], [1]).to_forward_batch()
    assert fb.sampling.penalties is None and fb.sampling.input_ids is None


def test_zero_penalties_are_no_penalties() -> None:
    keep = Req("plain", [1], SamplingParams(temperature=0.0, logit_bias={}, repetition_penalty=1.0))
    assert not keep.penalized


# --- validation --------------------------------------------------------------------------------------
@pytest.mark.parametrize("sp,param", [
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": -2.01}, "presence_penalty"),
    ({"presence_penalty": float("nan")}, "presence_penalty"),
    ({"frequency_penalty": "1"}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": 2.5}, "repetition_penalty"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": float("inf")}}, "logit_bias"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"min_new_tokens": -1}, "min_new_tokens"),
    ({"min_new_tokens": 9, "max_new_tokens": 8}, "min_new_tokens"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"max_new_tokens": 1 << 70}, "max_new_tokens"),
    ({"seed": 1 << 64}, "seed"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
])
def test_invalid_penalties_are_refused(sp: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        SamplingParams.from_dict(sp)
    assert e.value.param == param


def test_logit_bias_keys_become_ints_and_vocab_is_checked() -> None:
    p = SamplingParams.from_dict({"logit_bias": {"5": 1, "7": -100}})
    assert p.logit_bias == {5: 1.0, 7: -100.0} and p.has_penalties
    p.verify(vocab_size=8)
    with pytest.raises(InvalidRequest):
        p.verify(vocab_size=6)
    assert not SamplingParams.from_dict({"repetition_penalty": 1.0, "frequency_penalty": 0}).has_penalties


# --- the real engine, both scheduler loops ---------------------------------------------------------
@pytest.fixture(scope="module", params=[False, True], ids=["normal", "overlap"])
def engine(request: Any) -> Any:
    from radixserve.engine import Engine
    from radixserve.model.model_runner import ModelRunner

    return Engine(runner=ModelRunner(None, dtype="float32", progress=False), max_total_tokens=4096,
                  context_length=1024, overlap_schedule="on" if request.param else "off")


PROMPT = "Count: one, two, three,"
GREEDY = {"temperature": 0, "ignore_eos": True}


def test_engine_frequency_presence_match_step_by_step_logit_bias(engine: Any) -> None:
    """Penalized greedy decoding = decoding one token at a time with the penalties written out as a
    logit_bias (they are additive): the history reaches the sampler in both loops, pending token too.
    A batch neighbour without penalties decodes exactly as alone."""
    n = 10
    plain = engine.generate(PROMPT, {"max_new_tokens": n, **GREEDY})["output_ids"]
    outs = engine.generate([PROMPT, PROMPT], [{"max_new_tokens": n, "frequency_penalty": 1.5, "presence_penalty": 0.5,
                                               **GREEDY}, {"max_new_tokens": n, **GREEDY}])
    got, neighbour = outs[0]["output_ids"], outs[1]["output_ids"]
    assert neighbour == plain
    ids = engine.tokenizer.encode(PROMPT)
    ref: list[int] = []
    for _ in range(n):
        bias = {str(t): -(1.5 * ref.count(t) + 0.5) for t in set(ref)}
        out = engine.generate(input_ids=ids + ref, sampling_params={"max_new_tokens": 1, "logit_bias": bias, **GREEDY})
        ref.append(out["output_ids"][0])
    assert got == ref and got != plain


def test_engine_min_new_tokens_and_logit_bias(engine: Any) -> None:
    tok = engine.generate(PROMPT, {"max_new_tokens": 1, **GREEDY})["output_ids"][0]
    forced = {"logit_bias": {str(tok): 100}, "stop_token_ids": [tok], "temperature": 0}
    out = engine.generate(PROMPT, {"max_new_tokens": 8, **forced})
    assert out["output_ids"] == [tok]
    out = engine.generate(PROMPT, {"max_new_tokens": 8, "min_new_tokens": 3, **forced})
    assert len(out["output_ids"]) == 4 and out["output_ids"][-1] == tok and tok not in out["output_ids"][:3]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    engine.check_memory_invariant()


def test_engine_min_new_tokens_holds_back_a_stop_string(engine: Any) -> None:
    """A stop string seen before min_new_tokens does not end the output (EOS and stop ids are masked
    by the sampler; the string check waits in the scheduler)."""
    out = engine.generate(PROMPT, {"max_new_tokens": 6, **GREEDY})
    first = engine.tokenizer.decode(out["output_ids"][:1])
    stop = first.strip() or first
    early = engine.generate(PROMPT, {"max_new_tokens": 6, "stop": [stop], **GREEDY})
    assert len(early["output_ids"]) == 1
    held = engine.generate(PROMPT, {"max_new_tokens": 6, "stop": [stop], "min_new_tokens": 4, **GREEDY})
    assert len(held["output_ids"]) >= 4 and held["output_ids"][:4] == out["output_ids"][:4]
    engine.check_memory_invariant()
