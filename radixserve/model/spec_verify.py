"""Verifying draft tokens (speculative decoding): the target model's token at each drafted position.

A verify row extended a request by its last token and ``k`` draft tokens ``d1..dk``, so the model
produced ``k + 1`` logit rows: row ``j`` predicts the token after ``d_j`` (``d_0`` = the last
token). The drafts form a chain or a tree (``mem/draft_tree.py``); verification walks down it
from ``d_0``: at each node the target's token ``t``, and where ``t`` is one of the node's
children the walk goes on there (``draft_tree.walk``). For each row this returns the tokens along
the walk, ``t_0..t_a`` (``a`` drafts kept, ``t_a`` the target's own token where it stopped, the
bonus token if every draft on the path was kept), ``-1`` after, and the drafts walked into. In a
chain that is: keep ``d_{j+1}`` while ``t_j == d_{j+1}``.

- Greedy rows: ``t_j`` = the argmax of row ``j``: exactly the token plain decoding picks after the
  same tokens, so greedy output does not change with speculation.
- Sampled rows (rejection sampling with a draft distribution that puts all its mass on each draft,
  as n-gram drafts do): ``p_j`` is row ``j``'s distribution after temperature, min-p, top-k and
  top-p, as the sampler builds it. A child ``d`` is kept with probability ``p_j(d)``; otherwise it
  is removed and the next child is tried under what is left, renormalized; with none kept ``t_j``
  is drawn from the rest, which is never a draft. The kept tokens are then distributed exactly as
  tokens drawn one at a time from the target (Leviathan et al. 2023, with ``q`` a point mass).
- A seeded row draws a node's uniforms from ``seed_for_step(seed, step + depth)``: its output is
  reproducible, and independent of the rest of the batch.

- A row under a grammar: position ``j``'s logits are masked by the grammar after ``d_1..d_j``
  (``grammar.masks_along``; a draft the grammar refuses is never kept), and once the row's tokens
  are known its matcher consumes the kept ones, as the sampler's would one step at a time. A
  grammar that completes ends the kept tokens there.

- A row with penalties (frequency, presence, repetition, ``logit_bias``, ``min_new_tokens``):
  position ``j``'s logits are penalized as the sampler penalizes a decode row whose history ends
  with ``d_1..d_j`` (before the grammar's mask, as the sampler orders them).

Logprobs of the kept tokens come from the model's own logits (``verified_logprobs``), as the
sampler reports them for a decode row.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from radixserve.grammar import advance, masks_along
from radixserve.mem.draft_tree import chain, children, depths, is_chain, path_to, walk
from radixserve.mem.forward_batch import SamplingBatchInfo, VerifyRows
from radixserve.mem.penalties import RowPenalties
from radixserve.model.fused_ops import argmax_rows
from radixserve.model.sampler import _CANDIDATES, _GREEDY_EPS, _inverse_cdf, apply_penalties, seed_for_step


@torch.inference_mode()
def verify_drafts(
    last_logits: torch.Tensor, draft_logits: torch.Tensor, verify: VerifyRows, info: SamplingBatchInfo,
    generator: torch.Generator,
) -> tuple[list[list[int]], dict[int, str], list[list[int]]]:
    """``last_logits`` [B, V]: each batch row's last position; ``draft_logits`` [sum k, V]: the
    positions of ``verify.positions`` in order. Returns, per verify row, the target's tokens along
    the path it keeps (``t_0..t_a``, ``-1`` after: ``k + 1`` in all); the batch rows whose grammar
    ended with their kept tokens (as ``grammar.advance`` reports them); and per verify row the
    drafts walked into (its first ``a``)."""
    out: list[list[int]] = []
    paths: list[list[int]] = []
    ended: dict[int, str] = {}
    off = 0
    for v, (row, draft) in enumerate(zip(verify.rows, verify.drafts, strict=True)):
        k = len(draft)
        parents = verify.parents[v] if verify.parents is not None else chain(k)
        logits = torch.cat([draft_logits[off : off + k], last_logits[row : row + 1]]).float()
        off += k
        pens = info.penalties[row] if info.penalties is not None else None
        if pens is not None:
            logits = _penalized(logits, pens, draft, parents, info.steps[row] if row < len(info.steps) else pens.n_out)
        matcher = info.grammars[row] if info.grammars is not None else None
        if matcher is not None and matcher.is_stopped():
            matcher = None
        if matcher is not None:
            if not is_chain(parents):
                raise RuntimeError("a row under a grammar drafts a chain, not a tree")
            try:
                allowed = masks_along(matcher, draft, logits.shape[1])
                logits = torch.where(allowed, logits[: allowed.shape[0]], float("-inf"))
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:  # a Rust panic: this request ends with it, the batch goes on
                ended[row] = f"the grammar engine failed: {e!r}"
                matcher = None
        tokens, path = _pick(logits, draft, parents, row, info, generator)
        tokens += [-1] * (k + 1 - len(tokens))
        if matcher is not None:
            tokens = _consume_kept(matcher, draft, tokens, row, ended)
        out.append(tokens)
        paths.append(path)
    return out, ended, paths


def _penalized(logits: torch.Tensor, pens: RowPenalties, draft: list[int], parents: list[int], step: int) -> torch.Tensor:
    """A row's ``k + 1`` positions with its penalties applied as the sampler applies them to a
    decode row: the history of the position after draft ``j`` is the request's output followed by
    the drafts on ``j``'s path (``d_1..d_j`` in a chain), its step ``step + depth`` (``min_new_tokens``)."""
    n = logits.shape[0]
    hist = list(pens.output_ids[: pens.n_out])
    lines: list[list[int]] = [[]] + [[draft[a] for a in path_to(parents, j)] for j in range(n - 1)]
    rows = [replace(pens, output_ids=hist + line, n_out=len(hist) + len(line), pending_pos=-1) for line in lines]
    per_position = SamplingBatchInfo([0.0] * n, [1.0] * n, [-1] * n, [0.0] * n, [None] * n,
                                     [step + len(line) for line in lines], penalties=list(rows))
    return apply_penalties(logits, per_position)


def _consume_kept(matcher: object, draft: list[int], tokens: list[int], row: int, ended: dict[int, str]) -> list[int]:
    """Feed the row's matcher the tokens the scheduler will keep (the drafts while they agree, then
    the target's own); where the grammar ends (complete, or an error) the kept tokens end too."""
    k = len(draft)
    a = 0
    while a < k and tokens[a] == draft[a]:
        a += 1
    kept = [x for x in tokens[: a + 1] if x >= 0]
    for j, t in enumerate(kept):
        done = advance([matcher], [0], [t])
        if done:
            ended[row] = done[0]
            return kept[: j + 1] + [-1] * (k - j)
    return tokens


def _pick(logits: torch.Tensor, draft: list[int], parents: list[int], row: int, info: SamplingBatchInfo,
          generator: torch.Generator) -> tuple[list[int], list[int]]:
    """The walk down a row's drafts (``logits`` [n, V]: the last token's position, then each
    draft's): at each node the target's token; where it is one of the node's children the walk goes
    on there. Returns the tokens and the children walked into."""
    t, top_k = info.temperatures[row], info.top_ks[row]
    if t <= _GREEDY_EPS or top_k == 1:
        best = argmax_rows(logits).tolist()
        return walk(parents, draft, lambda j, _: best[j])
    n = logits.shape[0]
    probs = filtered_probs(logits, t, top_k, info.top_ps[row], info.min_ps[row])
    width = 1 + max(1, max(len(c) for c in children(parents)))  # a node's uniforms: one per child, one to draw
    seed = info.seeds[row]
    if seed is None:
        u = torch.rand(n, width, generator=generator)
    else:  # one stream per position's depth: the row's output is its seed's alone
        step = info.steps[row] if row < len(info.steps) else 0
        deep = [0, *depths(parents)]
        u = torch.cat([torch.rand(1, width, generator=torch.Generator().manual_seed(seed_for_step(seed, step + deep[j])))
                       for j in range(n)])
    return walk(parents, draft, lambda j, cands: _accept_or_redraw(probs[j], [draft[c] for c in cands], u[j]))


def _accept_or_redraw(probs: torch.Tensor, cands: list[int], u: torch.Tensor) -> int:
    """One position's token by rejection sampling over ``probs`` [V] (sums to 1) with point-mass
    drafts ``cands`` (distinct tokens): each in turn is kept with its probability under what the
    ones before it left (uniform ``u[i]``), else removed; with none kept, a draw from the rest
    (``u[max(1, len(cands))]``). The token is distributed as ``probs``."""
    rest = probs
    mass = 1.0
    for i, d in enumerate(cands):
        p = float(rest[d])
        if mass <= p or float(u[i]) < p / mass:  # (mass <= p: the candidates hold all that is left)
            return d
        if rest is probs:
            rest = probs.clone()
        rest[d] = 0.0
        mass -= p
    return int(_inverse_cdf(rest.view(1, -1), u[max(1, len(cands))].view(1, 1))[0])


def filtered_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Each row's sampling distribution [n, V] (rows sum to 1): softmax at ``temperature``, then
    the min-p, top-k and top-p filters as ``sampler._filtered_draw`` applies them (the kept set is
    their intersection; top-k/top-p work on the best ``_CANDIDATES`` tokens, or a full sort when a
    row's nucleus reaches past them)."""
    n, V = logits.shape
    probs = torch.softmax(logits / temperature, dim=-1)
    if min_p > 0:
        probs = probs.masked_fill(probs < probs.max(dim=-1, keepdim=True).values * min_p, 0.0)
    k = top_k if 0 < top_k < V else V
    if k == V and top_p >= 1.0:
        return probs / probs.sum(dim=-1, keepdim=True)
    kcap = min(V, max(_CANDIDATES, k if k < V else 0))
    vals, idx = probs.topk(kcap, dim=-1) if kcap < V else probs.sort(dim=-1, descending=True)
    if top_p < 1.0:
        cum = vals.cumsum(dim=-1)
        if kcap < V and k == V and bool(((cum[:, -1] < top_p) & (vals[:, -1] > 0)).any()):
            vals, idx = probs.sort(dim=-1, descending=True)  # a nucleus past the candidates: all of it
            cum = vals.cumsum(dim=-1)
        vals = vals.masked_fill((cum - vals) > top_p, 0.0)
    if k < V:
        vals = vals.masked_fill(torch.arange(vals.shape[1]).view(1, -1) >= k, 0.0)
    kept = torch.zeros_like(probs).scatter_(1, idx, vals)
    return kept / kept.sum(dim=-1, keepdim=True)


@torch.inference_mode()
def verified_logprobs(
    last_logits: torch.Tensor, draft_logits: torch.Tensor, verify: VerifyRows, verified: list[list[int]],
    paths: list[list[int]], top_ns: list[int], want_lp: bool,
) -> tuple[list[list[float]] | None, list[list[list[tuple[int, float]]]] | None]:
    """Per verify row and position of its kept path (``paths``, as ``verify_drafts`` returns them),
    the log-probability of its verified token (``want_lp``) and the ``top_ns[row]`` most likely
    tokens, from the model's own logits as the sampler reports them for a decode row (positions
    past what can be kept, ``-1``, get 0.0 and nothing)."""
    lps: list[list[float]] = []
    tops: list[list[list[tuple[int, float]]]] = []
    off = 0
    for row, draft, tokens, path in zip(verify.rows, verify.drafts, verified, paths, strict=True):
        k = len(draft)
        rows = [0] + [c + 1 for c in path]  # the logits rows the path's tokens come from
        rows += [0] * (len(tokens) - len(rows))  # (their tokens are -1)
        logits = torch.cat([draft_logits[off : off + k], last_logits[row : row + 1]])
        logp = torch.log_softmax(logits.index_select(0, torch.tensor(rows)).float(), dim=-1)
        off += k
        idx = torch.tensor([max(t, 0) for t in tokens], dtype=torch.int64).view(-1, 1)
        lp = logp.gather(1, idx).view(-1).tolist()
        lps.append([v if t >= 0 else 0.0 for v, t in zip(lp, tokens, strict=True)])
        n = min(top_ns[row] if row < len(top_ns) else 0, logp.shape[1])
        if n > 0:
            vals, ids = logp.topk(n, dim=-1)
            tops.append([list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), vals.tolist(), strict=True)])
        else:
            tops.append([[] for _ in tokens])
    return (lps if want_lp else None), (tops if any(n > 0 for n in top_ns) else None)
