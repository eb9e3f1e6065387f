"""Speculative decoding on the real model through ``Engine``: greedy outputs equal decoding without
it (token for token, float32 and bfloat16 in a batch, both event loops and both schedulers; under a JSON schema, with
penalties, and with the logprobs of every token), drafts are accepted on a prompt that asks for its
own text back, seeded sampling is reproducible, and the KV memory invariant holds after each run."""

from __future__ import annotations

import json
from importlib.resources import files

import pytest

from radixserve.engine import Engine
from radixserve.model.dequant import has_bf16_kernel
from radixserve.model.model_runner import ModelRunner

TEXT = files("radixserve.bench").joinpath("data/grounded.txt").read_text()
STORY = "<|im_start|>user\nWrite a short story about a robot who learns to paint.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner(None, dtype="float32")


def grounded_prompt(engine: Engine) -> str:
    return engine.apply_chat_template([{"role": "user", "content": "Here is a text:\n\n" + TEXT
                                        + "\n\nCopy its second paragraph word for word."}])


def pin_step_costs(engine: Engine) -> None:
    """Step costs that do not depend on this machine's load, so that the planner drafts on every
    run (a loaded machine's measured costs could make it decide drafting does not pay)."""
    spec = engine.scheduler.parts.spec
    if spec is not None:
        spec.costs.seconds = {n: 0.02 + 0.002 * n for n in range(1, 200)}
        spec.observe = lambda tokens, seconds: None


def generate(runner: ModelRunner, n: int, sp: dict | None = None, prompt: str | None = None, **kw: object) -> dict:
    engine = Engine(runner=runner, max_total_tokens=4096, context_length=2048, **kw)
    pin_step_costs(engine)
    try:
        out = engine.generate(prompt or grounded_prompt(engine),
                              {"temperature": 0.0, "max_new_tokens": n, **(sp or {})})
        engine.check_memory_invariant()
        return out
    finally:
        engine.shutdown()


def test_greedy_equals_plain_decoding_and_drafts_are_accepted(runner: ModelRunner) -> None:
    plain = generate(runner, 48)
    spec = generate(runner, 48, speculative_algorithm="ngram")
    assert spec["output_ids"] == plain["output_ids"]
    meta = spec["meta_info"]
    assert meta["spec_verify_ct"] > 0 and meta["spec_accepted_tokens"] > 0
    assert meta["spec_accept_length"] > 1.0
    assert "spec_verify_ct" not in plain["meta_info"]


@pytest.mark.slow
@pytest.mark.parametrize("kw", [{"overlap_schedule": "on"}, {"scheduler": "unified"}, {"page_size": 16}])
def test_greedy_equals_plain_decoding_everywhere(runner: ModelRunner, kw: dict) -> None:
    plain = generate(runner, 64, **kw)
    spec = generate(runner, 64, speculative_algorithm="ngram", **kw)
    assert spec["output_ids"] == plain["output_ids"]


LIST = ("Copy this list exactly:\n- the old red house by the sea\n- the old red car by the road\n"
        "- the old red door by the gate\n- the old red boat by the pier\n- the old red gate by the wall")


def test_draft_trees_keep_greedy_outputs(runner: ModelRunner) -> None:
    """A list whose items start alike (after "the old red" five continuations are in the prompt),
    copied with draft trees of up to three branches beside a request writing freely: the same
    tokens as decoding one at a time, and drafts branched."""
    def run(**kw: object) -> tuple[list[list[int]], int]:
        engine = Engine(runner=runner, max_total_tokens=4096, context_length=2048, **kw)
        pin_step_costs(engine)
        try:
            prompts = [engine.apply_chat_template([{"role": "user", "content": LIST}]), STORY]
            outs = engine.generate(prompts, {"temperature": 0.0, "max_new_tokens": 60})
            engine.check_memory_invariant()
            spec = engine.scheduler.parts.spec
            return [o["output_ids"] for o in outs], spec.stats.tree_rows if spec is not None else 0
        finally:
            engine.shutdown()

    got, trees = run(speculative_algorithm="ngram", speculative_ngram_max_bfs_breadth=3)
    assert trees > 0 and got == run()[0]


@pytest.mark.skipif(not has_bf16_kernel(), reason="bfloat16 decode rows past a few take oneDNN's GEMM here (no AVX512-BF16)")
def test_bfloat16_greedy_equals_plain_decoding_in_a_batch() -> None:
    """bfloat16 on AVX-512: a verify step's rows take the kernel its requests' decode rows take
    (integer dot products up to 4 requests), so three requests decoding together, drafting or not,
    give the same tokens."""
    runner = ModelRunner(None, dtype="bfloat16")
    engine = Engine(runner=runner, max_total_tokens=4096, context_length=2048)
    prompts = [grounded_prompt(engine), STORY, grounded_prompt(engine).replace("second", "first")]
    engine.shutdown()

    def run(**kw: object) -> tuple[list[list[int]], int]:
        engine = Engine(runner=runner, max_total_tokens=4096, context_length=2048, **kw)
        pin_step_costs(engine)
        try:
            outs = engine.generate(prompts, {"temperature": 0.0, "max_new_tokens": 40})
            engine.check_memory_invariant()
            return [o["output_ids"] for o in outs], sum(o["meta_info"].get("spec_accepted_tokens", 0) for o in outs)
        finally:
            engine.shutdown()

    spec, accepted = run(speculative_algorithm="ngram")
    assert spec == run()[0] and accepted > 0


def test_seeded_sampling_is_reproducible(runner: ModelRunner) -> None:
    sp = {"temperature": 0.7, "seed": 1234}
    a = generate(runner, 32, sp, speculative_algorithm="ngram")
    b = generate(runner, 32, sp, speculative_algorithm="ngram")
    assert a["output_ids"] == b["output_ids"] and len(a["output_ids"]) == 32


@pytest.fixture(scope="module")
def float_weights() -> ModelRunner:
    """The bundled model with its weights expanded to float32: the target that its own GGUF blocks
    draft for (``--speculative-algorithm draft`` without a draft path)."""
    return ModelRunner(None, dtype="float32", quantization="none")


@pytest.mark.slow
def test_draft_model_greedy_equals_plain_decoding(float_weights: ModelRunner) -> None:
    plain = generate(float_weights, 24, prompt=STORY)
    spec = generate(float_weights, 24, prompt=STORY, speculative_algorithm="draft")
    assert spec["output_ids"] == plain["output_ids"]
    meta = spec["meta_info"]
    # the same weights in 4-bit blocks: most drafts are the target's own tokens
    assert meta["spec_accepted_tokens"] > meta["spec_verify_ct"]
    assert float_weights.draft is not None
    generate(float_weights, 2, prompt=STORY)  # an engine without the draft algorithm drops the draft model
    assert float_weights.draft is None


@pytest.mark.slow
def test_draft_model_catches_up_after_steps_without_drafts(float_weights: ModelRunner) -> None:
    """Four requests decode together past --speculative-max-batch-size (no drafts, the draft model
    idle), then one goes on alone and drafts: it first catches up on the tokens it missed. Drafts
    from a draft whose KV were wrong would mostly be rejected; these are mostly accepted."""
    engine = Engine(runner=float_weights, max_total_tokens=4096, context_length=2048,
                    speculative_algorithm="draft", speculative_max_batch_size=1)
    pin_step_costs(engine)
    try:
        p = STORY
        outs = engine.generate([p] * 3 + [p + " Once"], [{"temperature": 0.0, "max_new_tokens": 6}] * 3
                               + [{"temperature": 0.0, "max_new_tokens": 30}])
        engine.check_memory_invariant()
    finally:
        engine.shutdown()
    meta = outs[3]["meta_info"]
    assert meta["spec_verify_ct"] > 0
    assert meta["spec_accepted_tokens"] >= 2 * meta["spec_verify_ct"]
    plain = Engine(runner=float_weights, max_total_tokens=4096, context_length=2048)
    try:
        assert plain.generate(p + " Once", {"temperature": 0.0, "max_new_tokens": 30})["output_ids"] == outs[3]["output_ids"]
    finally:
        plain.shutdown()


PEOPLE = {"type": "object", "properties": {"people": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
          "required": ["people"], "additionalProperties": False}


def test_structured_output_drafts_under_its_grammar(runner: ModelRunner) -> None:
    """A request under a JSON schema drafts (names and keys recur from its prompt); every verified
    position is masked by the grammar after the drafts before it, so the output is plain decoding's
    token for token, and the grammar still ends the request."""
    prompt = ("<|im_start|>user\nHere is a text:\n\n" + TEXT + "\n\nList the people it names, as JSON: "
              '{"people": [their names]}.<|im_end|>\n<|im_start|>assistant\n')
    sp = {"json_schema": json.dumps(PEOPLE)}
    plain = generate(runner, 160, sp, prompt=prompt)
    spec = generate(runner, 160, sp, prompt=prompt, speculative_algorithm="ngram")
    assert spec["output_ids"] == plain["output_ids"]
    assert spec["meta_info"]["finish_reason"]["type"] == "stop"
    assert isinstance(json.loads(spec["text"])["people"], list)
    assert spec["meta_info"]["spec_verify_ct"] > 0 and spec["meta_info"]["spec_accepted_tokens"] > 0


def test_logprobs_of_kept_drafts_are_plain_decodings(runner: ModelRunner) -> None:
    """A request that asks for logprobs drafts, and gets for every token the logprob and the top
    logprobs plain decoding reports (the verify step's logits are the decode step's, bit for bit)."""
    sp = {"logprobs": True, "top_logprobs_num": 3}
    plain = generate(runner, 40, sp)
    spec = generate(runner, 40, sp, speculative_algorithm="ngram")
    assert spec["output_ids"] == plain["output_ids"]
    assert spec["meta_info"]["spec_accepted_tokens"] > 0
    for key in ("output_token_logprobs", "output_top_logprobs"):
        assert spec["meta_info"][key] == plain["meta_info"][key], key


def test_penalties_apply_at_every_verified_position(runner: ModelRunner) -> None:
    """Frequency, presence and repetition penalties, a logit bias and min_new_tokens: each verified
    position is penalized as a decode step after the drafts before it would be, so the output is
    plain decoding's token for token."""
    sp = {"frequency_penalty": 0.3, "presence_penalty": 0.2, "repetition_penalty": 1.1,
          "logit_bias": {"13": -2.0}, "min_new_tokens": 3}
    plain = generate(runner, 48, sp)
    spec = generate(runner, 48, sp, speculative_algorithm="ngram")
    assert spec["output_ids"] == plain["output_ids"]
    assert spec["meta_info"]["spec_accepted_tokens"] > 0
