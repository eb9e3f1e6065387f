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


def test_prompt_logprobs_match_hf(fp32_runner: Any, hf_model: Any, harness: Harness) -> None:
    """Prompt logprobs (``ForwardBatch.prompt_logprobs``) of a fresh prompt and of an extend over a
    cached prefix, in one batch, against the log-softmax of transformers' logits at every position."""
    from radixserve.mem.forward_batch import PromptLogprobRows

    a, b = random_ids(40, seed=11), random_ids(30, seed=12)
    ra, rb = harness.new_request(), harness.new_request()
    fp32_runner.forward(harness.batch([rb], [b[:10]]))  # b's first 10 tokens are cached
    fb = harness.batch([ra, rb], [a, b[10:]])
    rows = PromptLogprobRows([])
    # a: positions 0..38 give tokens 1..39; b: positions 10..28 (flat 40..58) give tokens 11..29
    for row, flat, p, ids, top in [*((0, p, p, a, 3) for p in range(39)), *((1, 30 + p, p, b, 0) for p in range(10, 29))]:
        rows.positions.append(flat)
        rows.rows.append(row)
        rows.targets.append(ids[p + 1])
        rows.token_index.append(p + 1)
        rows.top_n.append(top)
    fb.prompt_logprobs = rows
    out = fp32_runner.forward(fb)
    assert out.prompt_logprobs is not None and out.prompt_logprobs.rows is rows
    with torch.inference_mode():
        ref_a = torch.log_softmax(hf_model(torch.tensor([a])).logits[0].float(), dim=-1)
        ref_b = torch.log_softmax(hf_model(torch.tensor([b])).logits[0].float(), dim=-1)
    want = [float(ref_a[p, a[p + 1]]) for p in range(39)] + [float(ref_b[p, b[p + 1]]) for p in range(10, 29)]
    assert out.prompt_logprobs.logprobs == pytest.approx(want, abs=2e-3)
    tops = out.prompt_logprobs.top_logprobs
    assert [t for t, _ in tops[5]] == ref_a[5].topk(3).indices.tolist()
    assert tops[40] == []
    # the rows the sampler reads are the last tokens' only, as without the extra rows
    assert out.logits is not None and out.logits.shape == (2, 49152)
    assert (torch.log_softmax(out.logits[0], dim=-1) - ref_a[-1]).abs().max() < 2e-3
