"""Structured output on the real tokenizer and model: grammar validation, the compiler and its cache,
the sampler's token masks (exact, and only on the rows that have a grammar), and the engine's
outputs following JSON schemas, regexes and GBNF grammars under both event loops."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
import torch

from radixserve.engine import Engine
from radixserve.grammar import (
    GrammarCompiler,
    GrammarError,
    advance,
    mask_logits,
    masks_along,
    validate_grammar,
)
from radixserve.mem.forward_batch import SamplingBatchInfo, VerifyRows
from radixserve.model.sampler import Sampler
from radixserve.model.spec_verify import verify_drafts

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "London", "Tokyo"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
PHONE = r"\+33 [0-9]{3}-[0-9]{4}"
YES_NO = 'root ::= "yes" | "no" | "maybe " [a-z]{1,8}'


@pytest.fixture(scope="module")
def compiler(fp32_runner: Any) -> GrammarCompiler:
    tok = fp32_runner.tokenizer
    return GrammarCompiler(tok.backend.to_str, fp32_runner.model_config.vocab_size, tok.stop_token_ids)


def test_validation_names_what_is_wrong() -> None:
    assert validate_grammar("json_schema", json.dumps(PERSON)) is None
    assert validate_grammar("regex", PHONE) is None
    assert validate_grammar("ebnf", YES_NO) is None
    assert validate_grammar("ebnf", 'start: "a" | "b"') is None  # Lark
    assert "objectx" in (validate_grammar("json_schema", '{"type": "objectx"}') or "")
    assert "JSON" in (validate_grammar("json_schema", '{"type": ') or "")
    assert "unclosed group" in (validate_grammar("regex", "(ab") or "")
    assert "foo" in (validate_grammar("ebnf", "root ::= foo") or "")


def test_compiler_caches_and_copies(compiler: GrammarCompiler) -> None:
    m1 = compiler.submit("regex", PHONE).result(timeout=60)
    m2 = compiler.cached("regex", PHONE)
    assert m2 is not None and m2 is not m1
    ids = compiler._tokenizer.tokenize_str("+33 1")  # type: ignore[union-attr]
    for t in ids:
        assert m1.consume_token(t)
    assert not m1.is_error() and not m2.is_stopped()
    # the copy starts from the beginning: "1" is not allowed first
    assert not m2.consume_token(ids[-1]) and m2.is_error()
    with pytest.raises(GrammarError):
        compiler.submit("json_schema", '{"type": "objectx"}').result(timeout=60)


def test_mask_is_exact_and_touches_only_its_row(compiler: GrammarCompiler, fp32_runner: Any) -> None:
    tok = fp32_runner.tokenizer
    V = fp32_runner.model_config.vocab_size
    matcher = compiler.submit("regex", "[0-9]{2}").result(timeout=60)
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    masked, failed = mask_logits(logits, [None, matcher, None], [1])
    assert failed == {}
    assert torch.equal(logits, before)  # the caller's logits are untouched
    assert torch.equal(masked[0], logits[0]) and torch.equal(masked[2], logits[2])
    allowed = {i for i in range(V) if not torch.isinf(masked[1, i])}
    digits = {i for i in range(V) if i not in tok.special_token_ids
              and re.fullmatch(rb"[0-9]{1,2}", tok.token_bytes(i)) is not None}
    assert allowed == digits and len(digits) >= 10
    assert torch.equal(masked[1, sorted(allowed)], logits[1, sorted(allowed)])
    # two digits and the grammar is complete; a token it refuses is an error
    one = tok.encode("7")[0]
    assert advance([matcher], [0], [one]) == {}
    assert advance([matcher], [0], [one]) == {0: ""}
    bad = compiler.submit("regex", "[0-9]{2}").result(timeout=60)
    err = advance([bad], [0], [tok.encode("x")[0]])
    assert err[0] != ""


def test_masks_along_drafts_and_verify_under_a_grammar(compiler: GrammarCompiler, fp32_runner: Any) -> None:
    """Speculative decoding: position j's mask is the grammar's after the first j drafts; a refused
    draft ends the masks there, a completing one too; the matcher is left as it was. Verifying
    drafts under the grammar keeps the allowed ones, and its matcher then holds the kept tokens."""
    tok = fp32_runner.tokenizer
    V = fp32_runner.model_config.vocab_size
    seven, x = tok.encode("7")[0], tok.encode("x")[0]
    matcher = compiler.submit("regex", "[0-9]{3}").result(timeout=60)
    masks = masks_along(matcher, [seven, seven, seven], V)
    assert masks.shape == (3, V)  # the third digit completes it: nothing after is needed
    assert all(bool(masks[j, seven]) for j in range(3)) and not masks[0, x]
    assert masks_along(matcher, [seven, x, seven], V).shape == (2, V)  # "x" refused at position 1
    assert not masks_along(matcher, [seven] * 3, V)[0, x]  # rolled back: "x" is still refused first
    assert advance([matcher], [0], [seven]) == {}  # the matcher now holds "7"
    # verify: drafts 7 x (x refused), greedy logits that prefer x everywhere and 7 next
    logits = torch.zeros(3, V)
    logits[:, x], logits[:, seven] = 10.0, 5.0
    info = SamplingBatchInfo.greedy(1)
    info.grammars = [matcher]
    tokens, ended, _ = verify_drafts(logits[2:], logits[:2], VerifyRows([0], [[seven, x]], [0, 1]), info,
                                  torch.Generator())
    # the draft 7 kept, then the target's 7 where x was refused: "777", the grammar is complete
    assert tokens == [[seven, seven, -1]] and ended == {0: ""}
    assert matcher.is_stopped()


def test_sampler_draws_only_what_the_grammar_allows(compiler: GrammarCompiler, fp32_runner: Any) -> None:
    """Random logits, sampled and greedy rows: every draw is allowed, the grammar completes, and the
    unconstrained row gets what it gets without any grammar in the batch."""
    V = fp32_runner.model_config.vocab_size
    tok = fp32_runner.tokenizer
    gen = torch.Generator().manual_seed(1)
    sampler, plain_sampler = Sampler(seed=7), Sampler(seed=7)
    matchers: list[Any] = [compiler.submit("regex", PHONE).result(timeout=60),
                           compiler.submit("ebnf", YES_NO).result(timeout=60), None]
    outs: list[list[int]] = [[], [], []]
    done: dict[int, int] = {}
    for step in range(20):
        logits = torch.randn(3, V, generator=gen) * 3
        info = SamplingBatchInfo([1.0, 0.0, 0.0], [0.9, 1.0, 1.0], [-1, -1, -1], [0.0] * 3, [None, 5, None],
                                 [step] * 3, grammars=[m if i not in done else None for i, m in enumerate(matchers)])
        res = sampler.sample(logits, info)
        plain = plain_sampler.sample(logits[2:3], SamplingBatchInfo([0.0], [1.0], [-1], [0.0], [None], [step]))
        assert res.next_token_ids[2] == plain.next_token_ids[0] == int(logits[2].argmax())
        for i in (0, 1):
            if i not in done:
                outs[i].append(res.next_token_ids[i])
        for i, err in (res.grammar_ended or {}).items():
            assert err == "" and i not in done
            done[i] = step
        if len(done) == 2:
            break
    assert set(done) == {0, 1}
    assert re.fullmatch(PHONE, tok.decode(outs[0]))
    assert re.fullmatch(r"yes|no|maybe [a-z]{1,8}", tok.decode(outs[1]))


def _requests() -> list[tuple[str, dict[str, Any]]]:
    return [
        ("Give me a JSON record of a person:", {"json_schema": json.dumps(PERSON)}),
        ("Give me any JSON object describing a cat:", {"json_schema": '{"type": "object"}'}),
        ("My phone number in Paris is", {"regex": PHONE}),
        ("Is the sky blue? Answer:", {"ebnf": YES_NO}),
        ("The capital of France is", {}),
        ("Write a JSON list of two colours:", {"json_schema": json.dumps(
            {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 2, "maxItems": 2})}),
    ]


def _check_outputs(outs: list[dict[str, Any]]) -> None:
    person, obj, phone, yes_no, _, colours = (o["text"] for o in outs)
    jsonschema.validate(json.loads(person), PERSON)
    assert isinstance(json.loads(obj), dict)
    assert re.fullmatch(PHONE, phone)
    assert re.fullmatch(r"yes|no|maybe [a-z]{1,8}", yes_no)
    assert json.loads(colours) in [[a, b] for a in ("red", "green", "blue") for b in ("red", "green", "blue")]
    for i in (0, 2, 3, 5):
        assert outs[i]["meta_info"]["finish_reason"] == {"type": "stop", "matched": None}, i


@pytest.mark.slow
def test_engine_outputs_follow_their_grammars(fp32_runner: Any) -> None:
    """A batch mixing every kind of grammar and none, greedy and sampled, under both event loops;
    the unconstrained request gets the tokens it gets alone."""
    reqs = _requests()
    texts = [t for t, _ in reqs]
    greedy_params = [{"max_new_tokens": 64, "temperature": 0, **g} for _, g in reqs]
    outs: dict[str, list[dict[str, Any]]] = {}
    for loop in ("overlap", "normal"):
        eng = Engine(runner=fp32_runner, max_total_tokens=8192, context_length=2048,
                     overlap_schedule="off" if loop == "normal" else "on")
        outs[loop] = eng.generate(texts, greedy_params)
        _check_outputs(outs[loop])
        if loop == "overlap":
            alone = eng.generate(texts[4], greedy_params[4])
            assert alone["output_ids"] == outs[loop][4]["output_ids"]
            _check_outputs(eng.generate(texts, [{"max_new_tokens": 64, "temperature": 1.0, "seed": 3, **g}
                                                for _, g in reqs]))
        eng.check_memory_invariant()
        eng.shutdown()
    assert [o["output_ids"] for o in outs["overlap"]] == [o["output_ids"] for o in outs["normal"]]


class _Broken:
    """A matcher whose engine fails (as a Rust panic would): only its own row is affected."""

    def is_stopped(self) -> bool:
        return False

    def unsafe_compute_mask_ptr(self, *a: Any) -> None:
        raise BaseException("panicked")


def test_a_failing_grammar_ends_its_row_only(compiler: GrammarCompiler, fp32_runner: Any) -> None:
    V = fp32_runner.model_config.vocab_size
    good = compiler.submit("regex", "[0-9]{2}").result(timeout=60)
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(2))
    info = SamplingBatchInfo.greedy(3)
    info.grammars = [good, _Broken(), None]
    res = Sampler(seed=1).sample(logits, info)
    assert res.grammar_ended is not None and set(res.grammar_ended) == {1}
    assert "panicked" in res.grammar_ended[1]
    assert res.next_token_ids[2] == int(logits[2].argmax()) and res.next_token_ids[1] == int(logits[1].argmax())
    assert not good.is_error()
