"""``verify_drafts``: greedy rows give the argmax at every position; sampled rows keep the tokens
distributed as the target's own draws (rejection sampling with point-mass drafts), whatever the
drafts were; seeded rows are reproducible."""

from __future__ import annotations

import math

import torch

from radixserve.mem.forward_batch import SamplingBatchInfo, VerifyRows
from radixserve.model.spec_verify import filtered_probs, verify_drafts

V = 6


def info(temperature: float, seed: int | None = None, top_k: int = -1, top_p: float = 1.0) -> SamplingBatchInfo:
    return SamplingBatchInfo([temperature], [top_p], [top_k], [0.0], [seed], [3])


def test_greedy_is_the_argmax_at_every_kept_position() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g)
    best = logits.argmax(dim=-1).tolist()
    draft = [best[0], best[1], (best[2] + 1) % 50]
    got, _, paths = verify_drafts(logits[3:], logits[:3], VerifyRows([0], [draft], [0, 1, 2]), info(0.0), g)
    assert got == [[*best[:3], -1]] and paths == [[0, 1]]


def kept_first_token(draft0: int, probs_logits: torch.Tensor, n: int, **kw: object) -> list[int]:
    """The first kept token of ``n`` verifications of a one-token draft."""
    g = torch.Generator().manual_seed(1)
    last = torch.zeros(1, V)
    counts = [0] * V
    for _ in range(n):
        t = verify_drafts(last, probs_logits.view(1, V), VerifyRows([0], [[draft0]], [0]), info(1.0, **kw), g)[0][0]
        counts[t[0]] += 1
    return counts


def test_rejection_sampling_keeps_the_target_distribution() -> None:
    """For each draft token (likely, unlikely, impossible under top-k), the first kept token's
    frequencies match the target distribution: a chi-square test at 0.1% significance with 6,000
    draws. Its power: the usual mistake (on a rejection, drawing from the whole distribution, the
    draft included) shifts the draft's share by ``(1 - p) p`` and is expected to score far past the
    critical value (checked below for every case)."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 6000
    for draft0, kw in ((0, {}), (4, {}), (5, {"top_k": 3}), (1, {"top_p": 0.8})):
        p = filtered_probs(logits.view(1, V), 1.0, kw.get("top_k", -1), kw.get("top_p", 1.0), 0.0)[0]
        counts = kept_first_token(draft0, logits, n, **kw)
        chi2 = sum((c - n * float(q)) ** 2 / (n * float(q)) for c, q in zip(counts, p.tolist(), strict=True) if q > 0)
        dof = sum(1 for q in p.tolist() if q > 0) - 1
        assert all(c == 0 for c, q in zip(counts, p.tolist(), strict=True) if q == 0), (draft0, counts)
        assert chi2 < _chi2_critical_0001(dof), (draft0, kw, counts, p.tolist(), chi2)
        q = p.clone()
        if q[draft0] > 0:  # the mistake's distribution, and its expected score
            q = q * (1 - q[draft0])
            q[draft0] += p[draft0]
            wrong = n * sum(float((a - b) ** 2 / b) for a, b in zip(q, p, strict=True) if b > 0)
            assert wrong > 3 * _chi2_critical_0001(dof), (draft0, wrong)


def _chi2_critical_0001(dof: int) -> float:
    """The chi-square 99.9% quantile (Wilson-Hilferty approximation, good to a few % here)."""
    z = 3.0902
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def test_seeded_rows_are_reproducible_and_stop_at_the_first_rejection() -> None:
    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(3))
    rows = VerifyRows([0], [[1, 2, 3]], [0, 1, 2])
    a, _, _ = verify_drafts(logits[3:], logits[:3], rows, info(0.8, seed=11), torch.Generator().manual_seed(5))
    b, _, _ = verify_drafts(logits[3:], logits[:3], rows, info(0.8, seed=11), torch.Generator().manual_seed(9))
    assert a == b and len(a[0]) == 4
    first_rejected = next((j for j, (t, d) in enumerate(zip(a[0], [1, 2, 3], strict=False)) if t != d), None)
    if first_rejected is not None:
        assert all(t == -1 for t in a[0][first_rejected + 1 :])


def test_filtered_probs_match_the_filters() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0, -2.0]])
    p = filtered_probs(logits, 1.0, 2, 1.0, 0.0)[0]
    assert (p[2:] == 0).all() and math.isclose(float(p.sum()), 1.0, rel_tol=1e-6)
    p = filtered_probs(logits, 1.0, -1, 0.5, 0.0)[0]
    assert float(p[0]) == 1.0  # the top token alone holds more than half
    p = filtered_probs(logits, 1.0, -1, 1.0, 0.3)[0]
    assert (p[2:] == 0).all() and float(p[1]) > 0  # min-p 0.3 of e^3: e^2 stays, e^1 goes


# --- draft trees ---------------------------------------------------------------------------

def test_greedy_walks_into_the_branch_the_target_takes() -> None:
    """Drafts a, b under the last token, c under b, e under a: the target prefers b, then c, then
    something else: the row keeps b and c, and its tokens are the target's along that path."""
    a, b, c, e, z = 11, 12, 13, 14, 15
    logits = torch.zeros(5, 20)  # rows: the last token, then each draft's position
    logits[0, b] = logits[2, c] = logits[3, z] = logits[1, e] = logits[4, 1] = 5.0
    rows = VerifyRows([0], [[a, b, c, e]], [0, 1, 2, 3], parents=[[-1, -1, 1, 0]])
    got, _, paths = verify_drafts(logits[4:], logits[:4], rows, info(0.0), torch.Generator())
    assert got == [[b, c, z, -1, -1]] and paths == [[1, 2]]


def test_sibling_drafts_keep_the_target_distribution() -> None:
    """Two sibling drafts under the last token: each is kept with its probability and, when the
    first is refused, the second with its probability among what is left; the first token's
    frequencies match the target's (the chi-square test above), and a kept sibling is walked into."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    p = filtered_probs(logits.view(1, V), 1.0, -1, 1.0, 0.0)[0]
    n, g = 6000, torch.Generator().manual_seed(2)
    counts = [0] * V
    rows = VerifyRows([0], [[1, 0]], [0, 1], parents=[[-1, -1]])
    for _ in range(n):
        got, _, paths = verify_drafts(torch.zeros(1, V), torch.stack([logits, torch.zeros(V)]), rows, info(1.0), g)
        t = got[0][0]
        counts[t] += 1
        assert paths[0] == ([0] if t == 1 else [1] if t == 0 else [])
    chi2 = sum((c - n * float(q)) ** 2 / (n * float(q)) for c, q in zip(counts, p.tolist(), strict=True))
    assert chi2 < _chi2_critical_0001(V - 1), (counts, p.tolist())
