"""Speculative decoding, the scheduler's side: n-gram drafts, their KV, and what was accepted.

With ``--speculative-algorithm ngram`` a decoding request may extend by its last token plus ``k``
draft tokens instead of one token. The drafts come from the request's own prompt and output
(prompt lookup): the longest suffix of its tokens (``--speculative-ngram-min/max-match-window-size``)
that occurred before, and the tokens that followed that occurrence. The target model verifies
them in the same forward (``model/spec_verify.py``); the scheduler keeps the drafts up to the first
one the target disagrees with, plus the target's own token there, so a step yields 1 to ``k + 1``
tokens.

With ``--speculative-algorithm draft`` the drafts come from a draft model in the runner
(``model/draft.py``): the scheduler decides how many tokens each request drafts (placeholders,
``DRAFT_BY_RUNNER``) and takes their KV slots; the runner fills them in before the verify forward
and returns them with the verified tokens. Everything below holds for both.

The scheduler owns it, as it owns every other token of a step:
- ``Speculation.draft`` runs when a step is built, after the KV check for the plain decode: the
  drafts' slots come from what is left (``room``); with too little room a request drafts less or
  nothing, so speculation never retracts a request. The drafts' KV slots are taken with the step's
  (``attach_drafts``) and count against ``--max-num-batched-tokens`` under ``--scheduler unified``.
- ``Speculation.accept`` reads the forward's ``verified`` tokens; ``Outputs`` appends them with the
  usual stop checks (a stop token or string, ``max_new_tokens`` part-way through the accepted
  tokens ends the request there) and gives back the KV of every position past the last kept one
  (``KVManager.truncate``): rejected drafts never reach the prefix cache.
- Every decoding request may draft: the verify step applies a request's penalties and its
  grammar's mask at every position as they would stand after the drafts before it, and reports
  logprobs for every kept position.

Adaptive: drafting pays only while the tokens it is expected to add are worth what verifying them
costs, and on a CPU a step's cost grows with its tokens (unevenly: kernels work in blocks of
rows). ``StepCosts`` keeps the measured time of decode steps by their token count; each request
keeps ``alpha``, its measured chance that a draft token is accepted (the ``i``-th draft token is
kept with probability ``alpha ** i``), by the length of the match the draft came from, starting
from what all requests measured for that length. Each step ``Speculation.draft`` takes the request's
candidates, orders every draft token by its expected value, and keeps the prefix of that order that
maximizes expected tokens per second of step (``plan``): a random chat whose drafts keep failing
drafts nothing, a text being quoted drafts long, a full batch drafts only its surest tokens.
Unmeasured token counts are estimated from the measured ones (optimistically, so they get tried
once and measured). ``--speculative-max-batch-size`` caps the batch that drafts at all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from radixserve.mem.forward_batch import ForwardOutput
from radixserve.sched.req import Req
from radixserve.sched.schedule_batch import DRAFT_BY_RUNNER, ScheduleBatch

_CANDIDATES = 8  # earlier occurrences of the match key looked at per draft, the latest first
_EMA = 0.3  # weight of the latest measurement in a request's acceptance and in a step cost
_RECOVER = 0.02  # how fast an idle request's acceptance returns to the prior, per step
_EXTRAPOLATE = 0.15  # an unmeasured larger step: this much of the largest measured one's per-token cost
_MIN_GAIN = 0.02  # drafts must promise at least this much more tokens per second than none
_STALE = 64  # steps after which a step cost is measured again rather than trusted
_SHARED_EMA = 0.05  # weight of one verify in the acceptance all requests share, per match class
# A draft's match class: how long the suffix it was found by (a one-token match is a guess, a
# twelve-token one mostly a quotation). Measured on the grounded workload: matches of 1-2 tokens
# kept 6-23% of their drafts, 3-5 tokens 55-100%, 6 or more ~70%.
_MATCH_CLASSES = (3, 6)  # the shortest match of the medium and of the long class
_CLASS_PRIORS = (0.2, 0.6, 0.7)  # the acceptance of each class before any request has verified


def match_class(length: int) -> int:
    return sum(length >= b for b in _MATCH_CLASSES)


@dataclass
class SpecStats:
    verify_steps: int = 0  # forwards that verified drafts
    verify_rows: int = 0  # request-steps that carried drafts
    draft_tokens: int = 0
    accepted_tokens: int = 0


def spec_counts(spec: Speculation | None) -> dict[str, int]:
    """The cumulative counters a scheduler reports (``SchedulerStats``); empty without speculation."""
    if spec is None:
        return {}
    s = spec.stats
    return {"spec_verify_rows": s.verify_rows, "spec_draft_tokens": s.draft_tokens,
            "spec_accepted_tokens": s.accepted_tokens}


class NgramDrafts:
    """A request's tokens (prompt + output, mirrored as they grow), an index from each
    ``min_n``-gram to the positions that followed it, and its measured acceptance by match class
    (``alpha``: the chance that a draft token of its latest proposal is accepted, given the ones
    before it were). ``shared``: the acceptance by class over all requests, which a request starts
    from, adds its verifies to, and drifts back to while idle."""

    __slots__ = ("tokens", "index", "indexed", "min_n", "max_n", "alphas", "shared", "cls")

    def __init__(self, req: Req, min_n: int, max_n: int, shared: list[float] | None = None) -> None:
        self.tokens: list[int] = list(req.origin_input_ids)
        self.index: dict[tuple[int, ...], list[int]] = {}
        self.indexed = 0  # n-grams ending before this position are in the index
        self.min_n, self.max_n = min_n, max_n
        self.shared = shared if shared is not None else list(_CLASS_PRIORS)
        self.alphas = list(self.shared)
        self.cls = len(_MATCH_CLASSES)  # the latest proposal's class (a draft model's drafts: the last)

    @property
    def alpha(self) -> float:
        return self.alphas[self.cls]

    def sync(self, req: Req) -> None:
        """Mirror the request's new output tokens and index the n-grams that now have a follower."""
        tokens, n = self.tokens, self.min_n
        have = len(tokens) - req.prompt_len
        if have < len(req.output_ids):
            tokens.extend(req.output_ids[have:])
        index = self.index
        for end in range(max(self.indexed, n), len(tokens)):  # the n-gram tokens[end-n:end] precedes tokens[end]
            key = tuple(tokens[end - n : end])
            pos = index.get(key)
            if pos is None:
                index[key] = [end]
            else:
                pos.append(end)
        self.indexed = max(self.indexed, len(tokens))

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest earlier match of the current suffix."""
        tokens, n = self.tokens, self.min_n
        L = len(tokens)
        if L <= n or k <= 0:
            return []
        hits = self.index.get(tuple(tokens[L - n :]))
        if not hits:
            return []
        best, best_len = -1, 0
        for p in reversed(hits[-_CANDIDATES:]):
            m = n
            while m < self.max_n and p - m - 1 >= 0 and tokens[p - m - 1] == tokens[L - m - 1]:
                m += 1
            if m > best_len:
                best, best_len = p, m
                if m == self.max_n:
                    break
        self.cls = match_class(best_len)
        return tokens[best : best + k] if best >= 0 else []

    def update(self, drafted: int, accepted: int) -> None:
        """After a verify step: ``accepted`` of ``drafted`` tokens kept (each kept draft a success,
        the first rejected one a failure)."""
        trials = accepted + (accepted < drafted)
        rate, c = accepted / trials, self.cls
        self.alphas[c] = (1 - _EMA) * self.alphas[c] + _EMA * rate
        self.shared[c] = (1 - _SHARED_EMA) * self.shared[c] + _SHARED_EMA * rate

    def idle(self) -> None:
        """A step without drafts: the estimates drift back towards the shared ones, so a request
        whose early drafts failed is tried again later (its text may have turned repetitive)."""
        for c, a in enumerate(self.alphas):
            self.alphas[c] = a + _RECOVER * (self.shared[c] - a)


class StepCosts:
    """Measured seconds of decode steps (verify steps included) by their token count, an EMA
    each; ``cost(n)`` estimates the counts not measured yet: between two measured counts on the
    line joining them, past the largest (or below the smallest) at its per-token cost times
    ``_EXTRAPOLATE`` (optimistic: it gets tried, then measured)."""

    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}
        self.seen: dict[int, int] = {}  # token count -> the observation it was last measured at
        self.observations = 0

    def observe(self, tokens: int, seconds: float) -> None:
        old = self.seconds.get(tokens)
        self.seconds[tokens] = seconds if old is None else (1 - _EMA) * old + _EMA * seconds
        self.observations += 1
        self.seen[tokens] = self.observations

    def cost(self, n: int) -> float | None:
        """Estimated seconds of a step of ``n`` tokens. A count not measured in the last
        ``_STALE`` steps counts as unmeasured (while a fresher one exists): one slow measurement
        (a busy machine, a long catch-up) does not rule a step size out for good."""
        s = self.seconds
        fresh = {m: v for m, v in s.items() if self.observations - self.seen.get(m, 0) <= _STALE}
        if fresh:
            s = fresh
        if n in s:
            return s[n]
        if not s:
            return None
        lo = max((m for m in s if m < n), default=None)
        hi = min((m for m in s if m > n), default=None)
        if lo is not None and hi is not None:
            return s[lo] + (s[hi] - s[lo]) * (n - lo) / (hi - lo)
        if lo is not None:
            return s[lo] * (1 + _EXTRAPOLATE * (n - lo) / lo)
        assert hi is not None
        return s[hi] * n / hi


def plan(batch_tokens: int, candidates: list[tuple[float, list[int]]], cost: StepCosts) -> list[int]:
    """How many of its candidate draft tokens each request verifies: the first ``m`` draft tokens of
    the batch by expected value (``alpha ** i`` for a request's ``i``-th), ``m`` maximizing expected
    tokens over the step's estimated cost. ``candidates``: per request, (alpha, its draft tokens)."""
    values = sorted(((alpha ** (i + 1), r) for r, (alpha, d) in enumerate(candidates) for i in range(len(d))),
                    key=lambda v: -v[0])
    base = cost.cost(batch_tokens)
    if not values or base is None:
        return [0] * len(candidates)
    best_m, best_rate, gain = 0, batch_tokens / base, float(batch_tokens)
    for m, (v, _) in enumerate(values, 1):
        gain += v
        c = cost.cost(batch_tokens + m)
        if c is not None and gain / c > best_rate * (1 + _MIN_GAIN):
            best_m, best_rate = m, gain / c
    counts = [0] * len(candidates)
    for _, r in values[:best_m]:
        counts[r] += 1
    return counts


def can_draft(req: Req) -> bool:
    """Whether ``req`` may draft this step: not while its prompt logprobs are still to come (the
    step that computes them samples its first token). Grammars, penalties and logprobs apply at
    every verified position (``model/spec_verify.py``)."""
    return not (req.input_logprob_start is not None and not req.output_ids)


class Speculation:
    def __init__(self, num_draft_tokens: int, min_window: int, max_window: int, max_batch_size: int,
                 by_runner: bool = False) -> None:
        """``by_runner``: the runner's draft model makes the drafts (``--speculative-algorithm
        draft``); the scheduler asks for a number of them per request (placeholders)."""
        self.by_runner = by_runner
        self.max_k = num_draft_tokens
        self.min_n, self.max_n = min_window, max(max_window, min_window)
        self.max_batch_size = max_batch_size
        self.stats = SpecStats()
        self.costs = StepCosts()
        self.match_alpha = list(_CLASS_PRIORS)  # shared by every request, by match class
        self.ahead = False  # the overlap loop is building a step ahead of the one in flight: no drafts

    def active(self, batch_size: int) -> bool:
        """Whether a step of ``batch_size`` requests drafts at all."""
        return not self.ahead and 0 < batch_size <= self.max_batch_size

    def observe(self, tokens: int, seconds: float) -> None:
        """A decode step (with or without drafts) of ``tokens`` tokens took ``seconds``."""
        self.costs.observe(tokens, seconds)

    def draft(self, reqs: list[Req], room: int, slots_for: Callable[[Req, int], int]) -> list[list[int]] | None:
        """Each request's drafts for a decode step of ``reqs`` (None: none drafts), as ``plan``
        chooses. ``room``: the KV slots the drafts may take; ``slots_for(req, k)``: the slots ``k``
        drafts of ``req`` take."""
        if not self.active(len(reqs)) or room <= 0:
            return None
        cands = [self.candidate(req, room, slots_for) for req in reqs]
        if not any(cands):
            self._idle(reqs, cands)
            return None
        counts = plan(len(reqs), [(r.spec.alpha if d else 0.0, d) for r, d in zip(reqs, cands, strict=True)],
                      self.costs)
        drafts: list[list[int]] = []
        for req, d, c in zip(reqs, cands, counts, strict=True):
            d = d[:c]
            while d and slots_for(req, len(d)) > room:
                d.pop()
            room -= slots_for(req, len(d)) if d else 0
            drafts.append(d)
        self._idle(reqs, drafts)
        return drafts if any(drafts) else None

    def draft_one(self, req: Req, room: int, slots_for: Callable[[Req, int], int], batch_tokens: int) -> list[int]:
        """``draft`` for one request of a step that has ``batch_tokens`` tokens without it (the
        unified scheduler decides request by request)."""
        d = self.candidate(req, room, slots_for)
        if d:
            d = d[: plan(batch_tokens, [(req.spec.alpha, d)], self.costs)[0]]
        self._idle([req], [d])
        return d

    def candidate(self, req: Req, room: int, slots_for: Callable[[Req, int], int]) -> list[int]:
        """``req``'s proposal: at most ``--speculative-num-draft-tokens``, none past
        ``max_new_tokens`` (the target's own token counts) and within ``room``; [] for a request
        that cannot draft."""
        if room <= 0 or not can_draft(req):
            return []
        st = req.spec
        if st is None:
            st = req.spec = NgramDrafts(req, self.min_n, self.max_n, self.match_alpha)
        k = min(self.max_k, req.sampling_params.max_new_tokens - len(req.output_ids) - 1)
        if k <= 0:
            return []
        if self.by_runner:
            d = [DRAFT_BY_RUNNER] * k
        else:
            st.sync(req)
            d = st.propose(k)
        while d and slots_for(req, len(d)) > room:
            d.pop()
        return d

    @staticmethod
    def _idle(reqs: list[Req], drafts: list[list[int]]) -> None:
        for req, d in zip(reqs, drafts, strict=True):
            if not d and req.spec is not None:
                req.spec.idle()

    def accept(self, batch: ScheduleBatch, out: ForwardOutput) -> dict[int, list[int]]:
        """Row -> the tokens a verify row keeps: its drafts while the target agreed, then the
        target's token (at most ``k + 1``). Updates each request's acceptance and the counters."""
        drafts, verified = batch.drafts, out.verified
        assert drafts is not None
        if verified is None:
            raise RuntimeError("the runner returned no verified tokens for a step with drafts")
        rows = [i for i, d in enumerate(drafts) if d]
        if len(verified) != len(rows):
            raise RuntimeError(f"the runner verified {len(verified)} rows, the step drafted {len(rows)}")
        if self.by_runner:  # the draft model's tokens, in place of the placeholders
            if out.drafts is None or [len(d) for d in out.drafts] != [len(drafts[i]) for i in rows]:
                raise RuntimeError("the runner did not return the drafts it was asked to make")
            drafts = list(drafts)
            for i, d in zip(rows, out.drafts, strict=True):
                drafts[i] = d
        kept: dict[int, list[int]] = {}
        s = self.stats
        s.verify_steps += 1
        for i, t in zip(rows, verified, strict=True):
            d = drafts[i]
            a = 0
            while a < len(d) and t[a] == d[a]:
                a += 1
            kept[i] = [x for x in t[: a + 1] if x >= 0]  # -1: past where a grammar ended the row
            req = batch.reqs[i]
            req.spec_verify_ct += 1
            req.spec_accepted_tokens += a
            s.verify_rows += 1
            s.draft_tokens += len(d)
            s.accepted_tokens += a
            if req.spec is not None:
                req.spec.update(len(d), a)
        return kept


def attach_drafts(batch: ScheduleBatch, drafts: list[list[int]], grow: Callable[[Req, int], list[int]]) -> None:
    """Turn a built decode step (one token and one slot per row, ``out_slots`` in row order) into
    one that also carries ``drafts``: each drafting row extends by ``1 + k``, with the slots that
    ``grow`` takes for its drafts right after its own."""
    flat: list[int] = []
    for i, (req, d, slot) in enumerate(zip(batch.reqs, drafts, batch.out_slots, strict=True)):
        flat.append(slot)
        if d:
            flat.extend(grow(req, len(d)))
            batch.extend_lens[i] = 1 + len(d)
    batch.out_slots = flat
    batch.drafts = drafts
