"""Speculative decoding on the real model through ``Engine``: greedy outputs equal decoding without
it (token for token, float32, both event loops and both schedulers), drafts are accepted on a
prompt that asks for its own text back, seeded sampling is reproducible, and the KV memory
invariant holds after each run."""

from __future__ import annotations

from importlib.resources import files

import pytest

from radixserve.engine import Engine
from radixserve.model.model_runner import ModelRunner

TEXT = files("radixserve.bench").joinpath("data/grounded.txt").read_text()


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner(None, dtype="float32")


def grounded_prompt(engine: Engine) -> str:
    return engine.apply_chat_template([{"role": "user", "content": "Here is a text:\n\n" + TEXT
                                        + "\n\nCopy its second paragraph word for word."}])


def generate(runner: ModelRunner, n: int, sp: dict | None = None, **kw: object) -> dict:
    engine = Engine(runner=runner, max_total_tokens=4096, context_length=2048, **kw)
    try:
        out = engine.generate(grounded_prompt(engine), {"temperature": 0.0, "max_new_tokens": n, **(sp or {})})
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


def test_seeded_sampling_is_reproducible(runner: ModelRunner) -> None:
    sp = {"temperature": 0.7, "seed": 1234}
    a = generate(runner, 32, sp, speculative_algorithm="ngram")
    b = generate(runner, 32, sp, speculative_algorithm="ngram")
    assert a["output_ids"] == b["output_ids"] and len(a["output_ids"]) == 32
