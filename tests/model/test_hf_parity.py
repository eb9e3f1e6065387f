"""Our Llama over the paged KV pool vs transformers' LlamaForCausalLM with the same weights (fp32)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from kvharness import Harness

from radixserve.mem.forward_batch import SamplingBatchInfo

pytestmark = pytest.mark.slow  # transformers' reference runs: the full tier

REL_TOL = 1e-4


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())


@pytest.fixture()
def harness(fp32_runner: Any) -> Harness:
    kv = fp32_runner.make_kv_pool(8192, page_size=16)
    r2t = fp32_runner.make_req_to_token_pool(16, 2048)
    fp32_runner.attach_pools(kv, r2t)
    return Harness(kv, r2t)


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def hf_last_logits(hf_model: Any, ids: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([ids])).logits[0, -1]


@pytest.mark.parametrize("n", [1, 10, 300, 1000])
def test_prefill_last_logits_match_hf(fp32_runner: Any, hf_model: Any, harness: Harness, n: int) -> None:
    ids = random_ids(n, seed=n)
    r = harness.new_request()
    out = fp32_runner.forward(harness.batch([r], [ids]))
    assert out.logits is not None and out.logits.shape == (1, 49152)
    assert out.logits.dtype == torch.float32
    assert rel_err(out.logits[0], hf_last_logits(hf_model, ids)) < REL_TOL


def test_batched_prefill_of_different_lengths(fp32_runner: Any, hf_model: Any, harness: Harness) -> None:
    prompts = [random_ids(n, seed=100 + n) for n in (7, 1, 33, 64)]
    reqs = [harness.new_request() for _ in prompts]
    out = fp32_runner.forward(harness.batch(reqs, prompts))
    assert out.logits is not None
    for i, ids in enumerate(prompts):
        assert rel_err(out.logits[i], hf_last_logits(hf_model, ids)) < REL_TOL


def test_extend_with_cached_prefix_equals_full_prefill(
    fp32_runner: Any, hf_model: Any, harness: Harness
) -> None:
    ids = random_ids(300, seed=7)
    full = harness.new_request()
    full_logits = fp32_runner.forward(harness.batch([full], [ids])).logits[0]

    # prefix computed by an earlier forward, then the rest as an extend with prefix_len=100
    split = harness.new_request()
    fp32_runner.forward(harness.batch([split], [ids[:100]]))
    fb = harness.batch([split], [ids[100:]])
    assert fb.extend_prefix_lens == [100]
    split_logits = fp32_runner.forward(fb).logits[0]
    assert rel_err(split_logits, full_logits) < 1e-5

    # prefix shared from another request's KV slots (what the radix cache does), no recompute
    shared = harness.fork(full, 100)
    shared_logits = fp32_runner.forward(harness.batch([shared], [ids[100:]])).logits[0]
    assert rel_err(shared_logits, full_logits) < 1e-5
    assert rel_err(full_logits, hf_last_logits(hf_model, ids)) < REL_TOL


def test_mixed_batch_decode_prefill_and_extend(fp32_runner: Any, hf_model: Any, harness: Harness) -> None:
    a_ids, b_ids, c_ids = random_ids(40, 1), random_ids(25, 2), random_ids(60, 3)
    a, c = harness.new_request(), harness.new_request()
    fp32_runner.forward(harness.batch([a, c], [a_ids[:-1], c_ids[:20]]))
    b = harness.new_request()
    # a: decode (1 new token), b: fresh prefill, c: extend of 40 on a 20-token prefix
    fb = harness.batch([a, b, c], [a_ids[-1:], b_ids, c_ids[20:]])
    assert fb.extend_seq_lens == [1, 25, 40] and not fb.is_decode_only
    out = fp32_runner.forward(fb)
    for i, ids in enumerate((a_ids, b_ids, c_ids)):
        assert rel_err(out.logits[i], hf_last_logits(hf_model, ids)) < REL_TOL


_HF_GREEDY: dict[tuple[int, ...], list[int]] = {}


@torch.inference_mode()
def hf_greedy(hf_model: Any, ids: list[int], steps: int) -> list[int]:
    key = (steps, *ids)
    if key not in _HF_GREEDY:
        _HF_GREEDY[key] = _hf_greedy(hf_model, ids, steps)
    return _HF_GREEDY[key]


def _hf_greedy(hf_model: Any, ids: list[int], steps: int) -> list[int]:
    out = hf_model(torch.tensor([ids]), use_cache=True)
    past, tokens = out.past_key_values, []
    for _ in range(steps):
        nxt = int(out.logits[0, -1].argmax())
        tokens.append(nxt)
        out = hf_model(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
    return tokens


@pytest.mark.parametrize("chunk_bytes", [None, 1])
def test_batched_greedy_decode_matches_hf(
    fp32_runner: Any,
    hf_model: Any,
    harness: Harness,
    chunk_bytes: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Prefill 4 chat prompts of different lengths together, then 15 batched decode steps.

    ``chunk_bytes=1`` makes the decode attention run one request per chunk (length-sorted)."""
    if chunk_bytes is not None:
        from radixserve.model import attention

        monkeypatch.setattr(attention, "DECODE_CHUNK_BYTES", chunk_bytes)
    tok = fp32_runner.tokenizer
    questions = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "List three prime numbers.",
        "Hi",
    ]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in questions]
    steps = 16
    reqs = [harness.new_request() for _ in prompts]
    out = fp32_runner.forward(harness.batch(reqs, prompts, SamplingBatchInfo.greedy(len(reqs))))
    generated = [[t] for t in out.next_token_ids]
    for _ in range(steps - 1):
        fb = harness.batch(reqs, [[g[-1]] for g in generated], SamplingBatchInfo.greedy(len(reqs)))
        assert fb.is_decode_only
        out = fp32_runner.forward(fb)
        for g, t in zip(generated, out.next_token_ids, strict=True):
            g.append(t)
    for ids, ours in zip(prompts, generated, strict=True):
        assert ours == hf_greedy(hf_model, ids, steps)
    assert "Paris" in tok.decode(generated[0])
