"""Greedy outputs of the whole engine equal HF transformers' token for token (float32, the same
dequantized weights), however the scheduler batches, caches, chunks or retracts.

The whole module is in the slow tier: HF's step-by-step reference and a couple of dozen engine runs
over prompts of up to 1,000 tokens take minutes on two cores. The policy sweep, the shared-prefix
test and the one-at-a-time run use fewer prompts or tokens than the rest: they test the order
requests run in, the cache hits and the single-request path."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from radixserve.engine import Engine
from radixserve.model.loader import load_model
from radixserve.model.model_runner import ModelRunner

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

NEW_TOKENS = 32  # past a page boundary and the first decode steps, where a KV slip shows
LENGTHS = [1, 5, 17, 40, 90, 150, 400, 700]  # the first six for the policy sweep
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}

TEXT = (
    "The history of computing is a story of abstraction layered on abstraction. Early machines were "
    "programmed by rewiring; then came stored programs, assemblers, compilers and operating systems. "
    "Each layer hid the one beneath it, and each let more people build more things. Today a request to "
    "a language model passes through a web server, a tokenizer, a scheduler, a memory manager and a "
    "neural network before a single word comes back. 12 + 30 = 42; naïve café déjà vu — 東京 — ✓. "
)


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner(None, dtype="float32")


@pytest.fixture(scope="module")
def text_ids(runner: ModelRunner) -> list[int]:
    ids = runner.tokenizer.encode(TEXT * 40)
    assert len(ids) > 1100
    return ids


@pytest.fixture(scope="module")
def prompts(text_ids: list[int]) -> list[list[int]]:
    return [text_ids[i * 7 : i * 7 + n] for i, n in enumerate(LENGTHS)]


def hf_greedy(model: Any, ids: list[int], n: int) -> list[int]:
    out: list[int] = []
    with torch.inference_mode():
        res = model(torch.tensor([ids]), use_cache=True)
        for _ in range(n):
            tok = int(res.logits[0, -1].argmax())
            out.append(tok)
            res = model(torch.tensor([[tok]]), past_key_values=res.past_key_values, use_cache=True)
    return out


@pytest.fixture(scope="module")
def hf_model(runner: ModelRunner) -> Any:
    from transformers.initialization import no_init_weights

    cfg = transformers.LlamaConfig(**runner.model_config.to_hf_dict())
    with no_init_weights():  # every weight is loaded below: a random init first is seconds wasted
        model = transformers.LlamaForCausalLM(cfg).to(torch.float32)
    missing, _ = model.load_state_dict(load_model(None, torch.float32, progress=False)[1], strict=False)
    assert set(missing) <= {"lm_head.weight"}, missing
    model.tie_weights()
    return model.eval()


def hf_greedy_batch(model: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    """``hf_greedy`` of each prompt, in one left-padded batch (HF's ``generate``, attention mask)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
    return [row[width:].tolist() for row in out]


@pytest.fixture(scope="module")
def reference(hf_model: Any, prompts: list[list[int]]) -> list[list[int]]:
    """HF's greedy tokens: the short prompts in one padded batch (step by step they cost the
    module most of its set-up), the long ones alone (padding the rest to them would cost more)."""
    short = [p for p in prompts if len(p) <= 150]
    assert prompts[: len(short)] == short
    return hf_greedy_batch(hf_model, short, NEW_TOKENS) + [hf_greedy(hf_model, p, NEW_TOKENS)
                                                             for p in prompts[len(short):]]


def _engine(runner: ModelRunner, **kw: Any) -> Engine:
    kw.setdefault("max_total_tokens", 16384)
    return Engine(runner=runner, dtype="float32", **kw)


def _check(outs: Any, reference: list[list[int]]) -> None:
    for i, (o, ref) in enumerate(zip(outs, reference, strict=True)):
        assert o["output_ids"] == ref, f"prompt {i} ({LENGTHS[i]} tokens) diverged"


def test_one_at_a_time(runner: ModelRunner, prompts: list[list[int]], reference: list[list[int]]) -> None:
    eng = _engine(runner)
    assert not eng.scheduler.overlap_enabled()  # --overlap-schedule auto: the normal loop on a CPU
    for i in range(0, len(prompts), 2):  # every other length: the same path, half the time
        out = eng.generate(input_ids=prompts[i], sampling_params=GREEDY)
        assert out["output_ids"] == reference[i], f"prompt {i} ({LENGTHS[i]} tokens) diverged"
    eng.check_memory_invariant()


@pytest.mark.parametrize("loop", ["overlap", "normal"])
def test_all_at_once(runner: ModelRunner, prompts: list[list[int]], reference: list[list[int]], loop: str) -> None:
    """Both event loops (--overlap-schedule on and off; the engine's default, auto, is off)."""
    eng = _engine(runner, overlap_schedule="off" if loop == "normal" else "on")
    assert eng.scheduler.overlap_enabled() is (loop == "overlap")
    _check(eng.generate(input_ids=prompts, sampling_params=GREEDY), reference)
    eng.check_memory_invariant()


# (offset step, tail length): tails of 1 to 200 tokens at spread offsets
SHARED_TAILS = [(0, 1), (4, 17), (8, 90), (11, 200)]
SHARED_TOKENS = 16  # what is tested is the cached prefix the first steps attend to
SHARED_PREFIX = 400


def test_shared_prefix_hits_cache(hf_model: Any, runner: ModelRunner, text_ids: list[int]) -> None:
    """4 prompts (401 to 600 tokens) behind one 400-token prefix: the first pays for it, the other
    3 find it in the radix cache, and all 4 still generate exactly HF's tokens."""
    base = text_ids[:SHARED_PREFIX]
    text = text_ids
    group = [base + text[SHARED_PREFIX + 13 * i : SHARED_PREFIX + 13 * i + n] for i, n in SHARED_TAILS]
    assert all(len(p) == SHARED_PREFIX + n for p, (_, n) in zip(group, SHARED_TAILS, strict=True))
    ref = hf_greedy_batch(hf_model, group, SHARED_TOKENS)  # alike in length: one padded batch
    eng = _engine(runner)
    params = dict(GREEDY, max_new_tokens=SHARED_TOKENS)
    first = eng.generate(input_ids=group[0], sampling_params=params)
    rest = eng.generate(input_ids=group[1:], sampling_params=params)
    assert isinstance(rest, list)
    outs = [first, *rest]
    for i, (o, r) in enumerate(zip(outs, ref, strict=True)):
        assert o["output_ids"] == r, f"shared-prefix prompt {i} diverged"
    assert first["meta_info"]["cached_tokens"] == 0
    for o in rest:
        assert o["meta_info"]["cached_tokens"] >= SHARED_PREFIX
    eng.check_memory_invariant()


def test_chunked_prefill(runner: ModelRunner, prompts: list[list[int]], reference: list[list[int]]) -> None:
    eng = _engine(runner, chunked_prefill_size=64)
    _check(eng.generate(input_ids=prompts, sampling_params=GREEDY), reference)
    steps = eng.scheduler.stats.step_log
    assert max(tokens for mode, _, tokens, _ in steps if mode == "EXTEND") <= 64
    eng.check_memory_invariant()


def test_mixed_chunk(runner: ModelRunner, prompts: list[list[int]], reference: list[list[int]]) -> None:
    """--enable-mixed-chunk: prompt chunks and running decodes share forwards (MIXED), same tokens."""
    eng = _engine(runner, chunked_prefill_size=96, enable_mixed_chunk=True)
    _check(eng.generate(input_ids=prompts, sampling_params=GREEDY), reference)
    assert any(mode == "MIXED" for mode, *_ in eng.scheduler.stats.step_log)
    eng.check_memory_invariant()


@pytest.mark.parametrize("loop", ["overlap", "normal"])
def test_retraction_under_tiny_pool(
    runner: ModelRunner, prompts: list[list[int]], reference: list[list[int]], loop: str,
) -> None:
    # the pool holds the prompts up to 400 tokens (703 in all) with little reserved for decoding,
    # so all are admitted and decoding runs out of KV (32 more tokens each) and must retract
    eng = _engine(runner, max_total_tokens=760, init_new_token_ratio=0.05,
                  overlap_schedule="off" if loop == "normal" else "on")
    _check(eng.generate(input_ids=prompts[:-1], sampling_params=GREEDY), reference[:-1])
    assert eng.scheduler.stats.num_retractions > 0
    eng.check_memory_invariant()


# Policies change the order requests run in, never what they generate. Each prompt is sent twice so
# the radix cache has something to reorder for, and few may run at once so the order matters.
POLICY_RUNS: dict[str, dict[str, Any]] = {
    "fcfs": {"schedule_policy": "fcfs"},
    "lpm": {"schedule_policy": "lpm", "lpm_fallback_threshold": 0},
    "dfs-weight": {"schedule_policy": "dfs-weight"},
    "lof": {"schedule_policy": "lof"},
    "random": {"schedule_policy": "random"},
    "sjf": {"schedule_policy": "sjf"},
    "edf": {"schedule_policy": "edf"},
    "vtc": {"schedule_policy": "vtc"},
    "lpm-aging": {"schedule_policy": "lpm", "priority_aging_rate": 1.0},
    "priority": {"schedule_policy": "fcfs", "enable_priority_scheduling": True},
    "unified-fcfs": {"scheduler": "unified", "max_num_batched_tokens": 256},
    "unified-priority": {"scheduler": "unified", "scheduling_policy": "priority", "max_num_batched_tokens": 256},
}
SWEEP_TOKENS = 8
SWEEP_PROMPTS = 6  # up to 150 tokens: the order changes, not what a longer prompt would add


@pytest.mark.parametrize("name", list(POLICY_RUNS))
def test_greedy_parity_under_every_policy(
    name: str, runner: ModelRunner, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    eng = _engine(runner, max_running_requests=4, chunked_prefill_size=256, **POLICY_RUNS[name])
    prompts = prompts[:SWEEP_PROMPTS]
    batch = prompts + prompts[::-1]
    priority: list[int | None] = [(0, 5, 20)[i % 3] for i in range(len(batch))]
    outs = eng.generate(input_ids=batch, sampling_params=dict(GREEDY, max_new_tokens=SWEEP_TOKENS),
                        priority=priority)
    refs = [r[:SWEEP_TOKENS] for r in reference]
    for i, o in enumerate(outs):
        j = i if i < len(prompts) else len(batch) - 1 - i
        assert o["output_ids"] == refs[j], f"{name}: request {i} ({LENGTHS[j]} tokens) diverged"
    assert sum(o["meta_info"]["cached_tokens"] for o in outs) > 0
    eng.check_memory_invariant()
