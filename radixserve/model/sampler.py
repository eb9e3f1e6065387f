"""Next-token sampling from ``[B, vocab]`` logits under per-request ``SamplingBatchInfo``.

- greedy (temperature ~0 or top_k == 1): argmax, with an all-greedy fast path;
- otherwise: temperature, then top-k, top-p and min-p filters, each computed on the
  temperature-scaled distribution (the kept set is their intersection, as in SGLang/vLLM);
- draws use inverse-CDF sampling (one uniform per row + cumsum + searchsorted): on CPU that is
  ~40x cheaper than ``torch.multinomial`` or exponential noise over a 49k vocabulary, and top-k /
  top-p work on a ``topk`` candidate set instead of a full sort (a larger set, then a full sort,
  are the fallbacks for a row whose nucleus does not fit in it);
- a request with a seed draws from ``torch.Generator().manual_seed(mix(seed, step))`` and is
  processed on its own row, so its tokens do not depend on what else is in the batch;
- logprobs (chosen token and top-n) come from the unmodified ``log_softmax(logits)``, as OpenAI's
  API reports them;
- penalties (``apply_penalties``), first, on a copy of the logits, only for the rows that have any
  (``info.penalties is None``: no request in the batch has one, nothing is done at all):
  1. ``repetition_penalty`` r (SGLang's, which is HF's formula over the *generated* tokens only, as
     SGLang applies it today; HF and vLLM also count the prompt): a logit of a token already
     generated is divided by r when positive, multiplied by r when negative;
  2. ``frequency_penalty`` f and ``presence_penalty`` p (OpenAI's): ``logit -= f * count + p * (count > 0)``
     with ``count`` the token's occurrences in the generated tokens;
  3. ``logit_bias`` (OpenAI's): the bias is added to the token's logit;
  4. ``min_new_tokens``: while fewer tokens than that are generated, EOS and the stop token ids are
     masked (-inf), so the request cannot finish by a token (a stop *string* still ends it).
  Counts are rebuilt each step from the token history (a scatter over the penalized rows' tokens).
- grammars (structured output, ``radixserve.grammar``), after the penalties: the tokens a row's
  grammar refuses are masked (-inf), and once the token is drawn the row's matcher consumes it
  (here, on the thread that runs the forward: the overlap loop's next step is built before this
  token is known, and its mask must come from the matcher after it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.grammar import advance, live_rows, mask_logits
from radixserve.mem.forward_batch import PromptLogprobRows, SamplingBatchInfo
from radixserve.mem.penalties import RowPenalties
from radixserve.model.fused_ops import argmax_rows

_GREEDY_EPS = 1e-6
_CANDIDATES = 256  # top-k / top-p work on the best this-many tokens when the filters fit in them
_MASK64 = (1 << 64) - 1


def seed_for_step(seed: int, step: int) -> int:
    """A well-mixed 63-bit seed from (request seed, generation step) (splitmix64)."""
    z = (int(seed) * 0x9E3779B97F4A7C15 + int(step) + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


@dataclass
class SampleOutput:
    next_token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    grammar_ended: dict[int, str] | None = None  # ForwardOutput.grammar_ended


class Sampler:
    def __init__(self, seed: int | None = None) -> None:
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, info: SamplingBatchInfo) -> SampleOutput:
        return self.sample(logits, info)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, info: SamplingBatchInfo) -> SampleOutput:
        logits = logits.float()
        B = logits.shape[0]
        if len(info.temperatures) != B:
            raise ValueError(f"sampling info is for {len(info.temperatures)} requests, logits for {B}")
        scores = logits if info.penalties is None else apply_penalties(logits, info)
        grammar_rows = live_rows(info.grammars) if info.grammars is not None else []
        grammar_failed: dict[int, str] = {}
        if grammar_rows:
            scores, grammar_failed = mask_logits(scores, info.grammars, grammar_rows)  # type: ignore[arg-type]
        if info.is_all_greedy:
            tokens = argmax_rows(scores)
        else:
            tokens = self._sample_mixed(scores, info)
        out = SampleOutput(next_token_ids=tokens.tolist())
        if grammar_rows:
            out.grammar_ended = advance(info.grammars, grammar_rows, out.next_token_ids,  # type: ignore[arg-type]
                                        grammar_failed) or None
        want_lp = bool(info.return_logprob) and any(info.return_logprob)
        top_ns = info.top_logprobs_nums or [0] * B
        want_top = any(n > 0 for n in top_ns)
        if want_lp or want_top:
            logp = torch.log_softmax(logits, dim=-1)
            if want_lp:
                out.logprobs = logp.gather(1, tokens.view(-1, 1)).view(-1).tolist()
            if want_top:
                kmax = min(max(top_ns), logp.shape[1])
                vals, idx = logp.topk(kmax, dim=-1)
                vl, il = vals.tolist(), idx.tolist()
                out.top_logprobs = [
                    list(zip(il[i][:n], vl[i][:n], strict=True)) for i, n in enumerate(top_ns)
                ]
        return out

    # ------------------------------------------------------------------ sampling
    def _sample_mixed(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        B = logits.shape[0]
        tokens = argmax_rows(logits)
        greedy = [t <= _GREEDY_EPS or k == 1 for t, k in zip(info.temperatures, info.top_ks, strict=True)]
        seeded = [i for i in range(B) if not greedy[i] and info.seeds[i] is not None]
        batched = [i for i in range(B) if not greedy[i] and info.seeds[i] is None]
        if batched:
            rows = torch.tensor(batched, dtype=torch.int64)
            sub = logits if len(batched) == B else logits.index_select(0, rows)
            drawn = _filtered_draw(
                sub,
                [info.temperatures[i] for i in batched],
                [info.top_ks[i] for i in batched],
                [info.top_ps[i] for i in batched],
                [info.min_ps[i] for i in batched],
                torch.rand(len(batched), 1, generator=self.generator),
            )
            tokens.index_copy_(0, rows, drawn)
        for i in seeded:
            seed = info.seeds[i]
            assert seed is not None
            step = info.steps[i] if i < len(info.steps) else 0
            g = torch.Generator().manual_seed(seed_for_step(seed, step))
            u = torch.rand(1, 1, generator=g)
            drawn = _filtered_draw(
                logits[i : i + 1].clone(),
                [info.temperatures[i]],
                [info.top_ks[i]],
                [info.top_ps[i]],
                [info.min_ps[i]],
                u,
            )
            tokens[i] = drawn[0]
        return tokens


def apply_penalties(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """``logits`` [B, V] with each row's penalties applied (``info.penalties``): a new tensor when any
    row has some, ``logits`` itself (untouched) otherwise."""
    pens = info.penalties or []
    rows = [i for i, r in enumerate(pens) if r is not None]
    prow = [r for r in pens if r is not None]
    if not rows:
        return logits
    dev = logits.device
    V = logits.shape[1]
    idx = torch.tensor(rows, dtype=torch.int64, device=dev)
    sub = logits.index_select(0, idx)  # a copy: the caller's logits stay as the model made them
    P = len(rows)
    counted = [j for j, r in enumerate(prow) if r.frequency or r.presence or r.repetition != 1.0]
    if counted:
        counts = _token_counts(prow, counted, P, V, info.input_ids, dev)
        seen = counts > 0
        rep = torch.tensor([r.repetition for r in prow], dtype=torch.float32, device=dev).view(P, 1)
        if any(prow[j].repetition != 1.0 for j in counted):
            scale = torch.where(seen, rep, torch.ones_like(sub))
            sub = torch.where(sub > 0, sub / scale, sub * scale)
        freq = torch.tensor([r.frequency for r in prow], dtype=torch.float32, device=dev).view(P, 1)
        pres = torch.tensor([r.presence for r in prow], dtype=torch.float32, device=dev).view(P, 1)
        if any(prow[j].frequency or prow[j].presence for j in counted):
            sub = sub - freq * counts - pres * seen.float()
    bias_rows: list[int] = []
    bias_ids: list[int] = []
    bias_vals: list[float] = []
    mask_rows: list[int] = []
    mask_ids: list[int] = []
    for j, r in enumerate(prow):
        if r.logit_bias:
            for t, b in r.logit_bias.items():
                if 0 <= t < V:
                    bias_rows.append(j)
                    bias_ids.append(t)
                    bias_vals.append(b)
        step = info.steps[rows[j]] if rows[j] < len(info.steps) else r.n_out
        if r.min_new_tokens > step:
            ids = [t for t in r.finish_ids if 0 <= t < V]
            mask_rows.extend([j] * len(ids))
            mask_ids.extend(ids)
    if bias_rows:
        sub = sub.index_put((torch.tensor(bias_rows, device=dev), torch.tensor(bias_ids, device=dev)),
                            torch.tensor(bias_vals, dtype=sub.dtype, device=dev), accumulate=True)
    if mask_rows:
        sub = sub.index_put((torch.tensor(mask_rows, device=dev), torch.tensor(mask_ids, device=dev)),
                            torch.tensor(float("-inf"), dtype=sub.dtype, device=dev))
    if P == logits.shape[0]:
        return sub
    return logits.index_copy(0, idx, sub)


def _token_counts(
    prow: list[RowPenalties], counted: list[int], P: int, V: int, input_ids: torch.Tensor | None, dev: torch.device
) -> torch.Tensor:
    """[P, V] float32: how often each token occurs in each row's generated tokens (zeros for rows
    outside ``counted``)."""
    hist_rows: list[int] = []
    hist_ids: list[int] = []
    pend_rows: list[int] = []
    pend_pos: list[int] = []
    for j in counted:
        r = prow[j]
        ids = r.output_ids[: r.n_out]
        hist_rows.extend([j] * len(ids))
        hist_ids.extend(ids)
        if r.pending_pos >= 0:
            pend_rows.append(j)
            pend_pos.append(r.pending_pos)
    row_t = torch.tensor(hist_rows, dtype=torch.int64, device=dev)
    tok_t = torch.tensor(hist_ids, dtype=torch.int64, device=dev)
    if pend_rows:
        if input_ids is None:
            raise ValueError("a pending token's penalty needs the forward's input ids")
        pos = torch.tensor(pend_pos, dtype=torch.int64, device=input_ids.device)
        row_t = torch.cat([row_t, torch.tensor(pend_rows, dtype=torch.int64, device=dev)])
        tok_t = torch.cat([tok_t, input_ids.index_select(0, pos).to(dev)])
    counts = torch.zeros(P, V, dtype=torch.float32, device=dev)
    ok = (tok_t >= 0) & (tok_t < V)
    counts.index_put_((row_t[ok], tok_t[ok]), torch.ones(int(ok.sum()), dtype=torch.float32, device=dev),
                      accumulate=True)
    return counts


def _filtered_draw(
    logits: torch.Tensor,
    temps: list[float],
    top_ks: list[int],
    top_ps: list[float],
    min_ps: list[float],
    u: torch.Tensor,
) -> torch.Tensor:
    """One token per row: temperature, top-k/top-p/min-p filters, inverse-CDF draw with ``u: [n, 1]``."""
    n, V = logits.shape
    t = torch.tensor(temps, dtype=torch.float32).view(n, 1)
    probs = torch.softmax(logits / t, dim=-1)
    if any(m > 0 for m in min_ps):
        pmax = probs.max(dim=-1, keepdim=True).values
        thr = pmax * torch.tensor(min_ps, dtype=torch.float32).view(n, 1)
        probs = probs.masked_fill(probs < thr, 0.0)
    ks = [k if 0 < k < V else V for k in top_ks]
    plain = [i for i in range(n) if ks[i] == V and top_ps[i] >= 1.0]
    if len(plain) == n:
        return _inverse_cdf(probs, u)
    out = torch.empty(n, dtype=torch.int64)
    if plain:
        rows = torch.tensor(plain, dtype=torch.int64)
        out.index_copy_(0, rows, _inverse_cdf(probs.index_select(0, rows), u.index_select(0, rows)))
    filt = [i for i in range(n) if ks[i] < V or top_ps[i] < 1.0]
    rows = torch.tensor(filt, dtype=torch.int64)
    sub = probs if len(filt) == n else probs.index_select(0, rows)
    u_sub = u if len(filt) == n else u.index_select(0, rows)
    drawn = _draw_top_k_top_p(sub, [ks[i] for i in filt], [top_ps[i] for i in filt], u_sub, _CANDIDATES)
    if len(filt) == n:
        return drawn
    out.index_copy_(0, rows, drawn)
    return out


def _draw_top_k_top_p(
    probs: torch.Tensor, ks: list[int], ps: list[float], u: torch.Tensor, kcap: int
) -> torch.Tensor:
    """Draw under top-k (``k == V``: off) and top-p from the ``kcap`` best tokens of each row.

    A row without top-k whose nucleus reaches past the candidates is redone with 16x as many
    (then the full sort): flat distributions are rare, and a full sort costs ~2 ms per row here."""
    m, V = probs.shape
    finite_k = [k for k in ks if k < V]
    kcap = min(V, max([kcap, *finite_k]))
    if kcap < V:
        vals, idx = probs.topk(kcap, dim=-1)  # sorted, descending
    else:
        vals, idx = probs.sort(dim=-1, descending=True)
    redo: list[int] = []
    if any(p < 1.0 for p in ps):
        p = torch.tensor(ps, dtype=torch.float32).view(m, 1)
        cum = vals.cumsum(dim=-1)
        if kcap < V:
            no_k = torch.tensor([k == V for k in ks])
            short = (cum[:, -1:] < p).view(-1) & (vals[:, -1] > 0) & no_k  # nucleus not all inside
            redo = short.nonzero().view(-1).tolist()
        vals = vals.masked_fill((cum - vals) > p, 0.0)
    if finite_k:
        rank = torch.arange(kcap).view(1, -1)
        vals = vals.masked_fill(rank >= torch.tensor(ks).view(m, 1), 0.0)
    drawn = idx.gather(1, _inverse_cdf(vals, u).view(m, 1)).view(m)
    if redo:
        r = torch.tensor(redo, dtype=torch.int64)
        again = _draw_top_k_top_p(
            probs.index_select(0, r),
            [ks[i] for i in redo],
            [ps[i] for i in redo],
            u.index_select(0, r),
            kcap * 16,
        )
        drawn.index_copy_(0, r, again)
    return drawn


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index drawn with probability proportional to ``weights`` (rows, non-negative, unnormalized)."""
    cdf = weights.cumsum(dim=-1)
    total = cdf[:, -1:].contiguous()
    pick = torch.searchsorted(cdf, u * total, right=True)
    # u * total can round up to total: never step past the last token with weight
    last = torch.searchsorted(cdf, total, right=False)
    return torch.minimum(pick, last).view(-1)


PROMPT_LOGPROB_CHUNK = 256  # rows per log-softmax: a 2,048-token prompt chunk's copy stays small


@torch.inference_mode()
def prompt_logprobs(logits: torch.Tensor, rows: PromptLogprobRows) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """Each prompt position's log-probability of the token that follows it, and its top ``top_n``
    (token, logprob) pairs, from the raw logits (as the output tokens' logprobs are)."""
    targets = torch.tensor(rows.targets, dtype=torch.int64).view(-1, 1)
    kmax = min(max(rows.top_n, default=0), logits.shape[1])
    lps: list[float] = []
    tops: list[list[tuple[int, float]]] = []
    for a in range(0, logits.shape[0], PROMPT_LOGPROB_CHUNK):
        logp = torch.log_softmax(logits[a : a + PROMPT_LOGPROB_CHUNK].float(), dim=-1)
        lps.extend(logp.gather(1, targets[a : a + PROMPT_LOGPROB_CHUNK]).view(-1).tolist())
        if kmax:
            vals, idx = logp.topk(kmax, dim=-1)
            for il, vl, n in zip(idx.tolist(), vals.tolist(), rows.top_n[a : a + PROMPT_LOGPROB_CHUNK], strict=True):
                tops.append(list(zip(il[:n], vl[:n], strict=True)))
        else:
            tops.extend([] for _ in range(logp.shape[0]))
    return lps, tops
