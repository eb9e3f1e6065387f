"""``radixserve bench offline`` on a tiny workload: the engine run, the HF run on the same prompts and
the decode-step probe report what they measured, and the engine drains clean afterwards."""

from __future__ import annotations

import math

import pytest

from radixserve.bench.offline import decode_step_ms, matmul_only_ms, run_engine, run_hf
from radixserve.bench.workloads import make_workload
from radixserve.engine import Engine
from radixserve.model.model_runner import ModelRunner

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(runner=ModelRunner(None, dtype="float32"), max_total_tokens=4096, context_length=1024)


@pytest.mark.slow
def test_engine_and_hf_runs_count_the_same_tokens(engine: Engine) -> None:
    reqs = make_workload("shared-prefix", num_groups=2, prompts_per_group=3, system_len=40, question_len=8,
                         output_len=5)
    ours = run_engine(engine, reqs, "shared-prefix")
    assert ours.num_requests == 6
    assert ours.output_tokens == 6 * 5  # ignore_eos: every request generates exactly its budget
    assert ours.input_tokens == 6 * 48
    assert ours.cache_hit_rate == 0.0  # all six are prefilled in one batch: nothing cached yet
    again = run_engine(engine, reqs, "shared-prefix")
    assert again.cache_hit_rate == 47 / 48  # each whole prompt but its last token, which is recomputed
    assert ours.ttft_p50_s is not None and 0 < ours.ttft_p50_s <= ours.ttft_p95_s <= ours.duration_s
    hf = run_hf(engine, reqs, "shared-prefix", batch_size=4)
    assert (hf.output_tokens, hf.input_tokens) == (ours.output_tokens, ours.input_tokens)
    assert hf.cache_hit_rate is None
    engine.check_memory_invariant()


def test_decode_step_probe_times_exactly_the_asked_batch(engine: Engine) -> None:
    step, forward = decode_step_ms(engine, batch=4, input_len=16, steps=4)
    assert math.isfinite(step) and math.isfinite(forward)
    # the whole engine step contains the runner forward; under the overlap loop (the default) a
    # step's interval is about its forward, the scheduling hidden under it, so the two medians may
    # cross by a little
    slack = 1.1 if engine.scheduler.overlap_enabled() else 1.0
    assert 0 < forward <= step * slack
    assert matmul_only_ms(engine, 4, iters=1) > 0
    engine.check_memory_invariant()
