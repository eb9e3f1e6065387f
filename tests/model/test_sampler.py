from __future__ import annotations

import pytest
import torch

from radixserve.mem.forward_batch import SamplingBatchInfo
from radixserve.model.sampler import Sampler

V = 49152


def make_logits(b: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, V, generator=torch.Generator().manual_seed(seed)) * 3


def info(
    n: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = -1,
    min_p: float = 0.0,
    seeds: list[int | None] | None = None,
    steps: list[int] | None = None,
    logprobs: bool = False,
    top_n: int = 0,
) -> SamplingBatchInfo:
    return SamplingBatchInfo(
        temperatures=[temperature] * n,
        top_ps=[top_p] * n,
        top_ks=[top_k] * n,
        min_ps=[min_p] * n,
        seeds=seeds if seeds is not None else [None] * n,
        steps=steps if steps is not None else [0] * n,
        return_logprob=[logprobs] * n,
        top_logprobs_nums=[top_n] * n,
    )


def test_greedy_is_argmax() -> None:
    logits = make_logits(8)
    out = Sampler(0).sample(logits, SamplingBatchInfo.greedy(8))
    assert out.next_token_ids == logits.argmax(-1).tolist()
    assert out.logprobs is None and out.top_logprobs is None


def test_top_k_1_is_argmax() -> None:
    logits = make_logits(8, 1)
    out = Sampler(0).sample(logits, info(8, temperature=1.5, top_k=1))
    assert out.next_token_ids == logits.argmax(-1).tolist()


def test_tiny_top_p_is_argmax() -> None:
    logits = make_logits(8, 2)
    for _ in range(5):
        out = Sampler().sample(logits, info(8, temperature=1.0, top_p=1e-6))
        assert out.next_token_ids == logits.argmax(-1).tolist()


def test_mixed_greedy_and_sampled_rows() -> None:
    logits = make_logits(4, 3)
    i = info(4, temperature=1.0)
    i.temperatures[1] = 0.0
    i.top_ks[2] = 1
    out = Sampler(0).sample(logits, i)
    assert out.next_token_ids[1] == int(logits[1].argmax()) and out.next_token_ids[2] == int(
        logits[2].argmax()
    )


def test_min_p_filters() -> None:
    # two strong tokens, the rest far below min_p * p_max
    logits = torch.full((1, V), -5.0)
    logits[0, 10] = 5.0
    logits[0, 20] = 4.5
    seen = set()
    sampler = Sampler(0)
    for _ in range(200):
        seen.update(sampler.sample(logits, info(1, temperature=1.0, min_p=0.1)).next_token_ids)
    assert seen == {10, 20}
    # without min_p the tail (~49k tokens at e^-10 each, ~0.3 of the mass) does get drawn
    tail = sum(
        t not in (10, 20)
        for _ in range(100)
        for t in sampler.sample(logits, info(1, temperature=1.0)).next_token_ids
    )
    assert tail > 0


def test_top_k_and_top_p_restrict_support() -> None:
    logits = make_logits(1, 4)
    order = logits[0].argsort(descending=True).tolist()
    sampler = Sampler(0)
    got_k = {sampler.sample(logits, info(1, temperature=2.0, top_k=5)).next_token_ids[0] for _ in range(300)}
    assert got_k <= set(order[:5]) and len(got_k) > 1
    probs = torch.softmax(logits[0], -1)[order]
    n_nucleus = int((probs.cumsum(0) - probs < 0.5).sum())
    got_p = {
        sampler.sample(logits, info(1, temperature=1.0, top_p=0.5)).next_token_ids[0] for _ in range(300)
    }
    assert got_p <= set(order[:n_nucleus])


def test_top_p_beyond_candidate_set_falls_back_to_full_sort() -> None:
    logits = torch.zeros(1, V)  # flat: a 0.9 nucleus is ~44k tokens, far past the topk candidates
    got = {Sampler(s).sample(logits, info(1, top_p=0.9)).next_token_ids[0] for s in range(50)}
    assert len(got) > 40


def test_same_seed_same_tokens_regardless_of_batch() -> None:
    logits = make_logits(6, 5)
    target = logits[3:4].clone()
    alone = [
        Sampler(1)
        .sample(target, info(1, temperature=0.9, top_p=0.95, seeds=[42], steps=[s]))
        .next_token_ids[0]
        for s in range(20)
    ]
    for other_seed in (0, 99):
        batched = []
        for s in range(20):
            i = info(6, temperature=0.9, top_p=0.95, seeds=[None, 7, None, 42, None, 5], steps=[s] * 6)
            i.top_ks[0] = 50  # other rows with other parameters
            batched.append(Sampler(other_seed).sample(logits, i).next_token_ids[3])
        assert batched == alone
    assert len(set(alone)) > 1  # the step changes the draw


def test_unseeded_sampling_varies() -> None:
    logits = make_logits(1, 6) * 0.1
    sampler = Sampler()
    draws = {sampler.sample(logits, info(1, temperature=1.0)).next_token_ids[0] for _ in range(20)}
    assert len(draws) > 1


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_are_unmodified_log_softmax(temperature: float) -> None:
    logits = make_logits(4, 7)
    out = Sampler(0).sample(logits, info(4, temperature=temperature, top_k=20, logprobs=True, top_n=3))
    logp = torch.log_softmax(logits, -1)
    assert out.logprobs is not None and out.top_logprobs is not None
    for i, t in enumerate(out.next_token_ids):
        assert out.logprobs[i] == pytest.approx(float(logp[i, t]), abs=1e-6)
        vals, idx = logp[i].topk(3)
        assert [tid for tid, _ in out.top_logprobs[i]] == idx.tolist()
        assert [lp for _, lp in out.top_logprobs[i]] == pytest.approx(vals.tolist(), abs=1e-6)
