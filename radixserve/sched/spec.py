"""Speculative decoding, the scheduler's side: n-gram drafts, their KV, and what was accepted.

With ``--speculative-algorithm ngram`` a decoding request may extend by its last token plus ``k``
draft tokens instead of one token. The drafts come from the request's own prompt and output
(prompt lookup): the longest suffix of its tokens (``--speculative-ngram-min/max-match-window-size``)
that occurred before, and the tokens that followed that occurrence (``spec_ngram.py``); with
``--speculative-ngram-max-bfs-breadth`` above 1, the next best occurrences' continuations too, as
branches of a draft tree (``mem/draft_tree.py``). The target model verifies them in the same
forward (``model/spec_verify.py``); the scheduler keeps the drafts down the path the target agrees
with, plus the target's own token where it stops, so a step yields 1 to ``k + 1`` tokens. A tree
row's drafts hold KV slots in draft order; the kept path's slots move to the front
(``KVManager.keep_path``: page size 1, where a slot is a position) before the rest is cut off.

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
candidates (a tree's nodes valued as ``DraftTree`` says), orders every draft token by its expected
value, and keeps the prefix of that order that
maximizes expected tokens per second of step (``plan``): a random chat whose drafts keep failing
drafts nothing, a text being quoted drafts long, a full batch drafts only its surest tokens.
Unmeasured token counts are estimated from the measured ones (optimistically, so they get tried
once and measured). ``--speculative-max-batch-size`` caps the batch that drafts at all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from radixserve.mem.draft_tree import is_chain
from radixserve.mem.forward_batch import ForwardOutput
from radixserve.sched.req import Req
from radixserve.sched.schedule_batch import DRAFT_BY_RUNNER, ScheduleBatch
from radixserve.sched.spec_ngram import _CLASS_PRIORS, EMA, DraftTree, NgramDrafts

_EXTRAPOLATE = 0.15  # an unmeasured larger step: this much of the largest measured one's per-token cost
_MIN_GAIN = 0.02  # drafts must promise at least this much more tokens per second than none
_STALE = 64  # steps after which a step cost is measured again rather than trusted


@dataclass
class SpecStats:
    verify_steps: int = 0  # forwards that verified drafts
    verify_rows: int = 0  # request-steps that carried drafts
    draft_tokens: int = 0
    accepted_tokens: int = 0
    tree_rows: int = 0  # request-steps whose drafts branched
    side_paths: int = 0  # of those, the ones that kept a path other than the first branch


def spec_counts(spec: Speculation | None) -> dict[str, int]:
    """The cumulative counters a scheduler reports (``SchedulerStats``); empty without speculation."""
    if spec is None:
        return {}
    s = spec.stats
    return {"spec_verify_rows": s.verify_rows, "spec_draft_tokens": s.draft_tokens,
            "spec_accepted_tokens": s.accepted_tokens}


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
        self.seconds[tokens] = seconds if old is None else (1 - EMA) * old + EMA * seconds
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


def chain_values(alpha: float, n: int) -> list[float]:
    """The values of ``n`` chained draft tokens each kept with probability ``alpha`` given the ones
    before it were: ``alpha ** i`` for the ``i``-th."""
    return [alpha ** (i + 1) for i in range(n)]


def plan(batch_tokens: int, candidates: list[list[float]], cost: StepCosts) -> list[int]:
    """How many of its candidate draft tokens each request verifies: the first ``m`` draft tokens of
    the batch by expected value, ``m`` maximizing expected tokens over the step's estimated cost.
    ``candidates``: per request, its draft tokens' values (their chance of being kept), in an order
    where a token never comes after one of lower value (a tree's nodes by value, ``DraftTree``):
    each request keeps a prefix of its own."""
    values = sorted(((v, r) for r, vs in enumerate(candidates) for v in vs), key=lambda v: -v[0])
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
                 by_runner: bool = False, breadth: int = 1) -> None:
        """``by_runner``: the runner's draft model makes the drafts (``--speculative-algorithm
        draft``); the scheduler asks for a number of them per request (placeholders). ``breadth``:
        the most n-gram matches a request's draft tree follows (1: a chain)."""
        self.by_runner = by_runner
        self.max_k = num_draft_tokens
        self.min_n, self.max_n = min_window, max(max_window, min_window)
        self.max_batch_size = max_batch_size
        self.breadth = max(1, breadth)
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

    def draft(self, reqs: list[Req], room: int, slots_for: Callable[[Req, int], int]) -> list[DraftTree] | None:
        """Each request's drafts for a decode step of ``reqs`` (None: none drafts), as ``plan``
        chooses. ``room``: the KV slots the drafts may take; ``slots_for(req, k)``: the slots ``k``
        drafts of ``req`` take."""
        if not self.active(len(reqs)) or room <= 0:
            return None
        cands = [self.candidate(req, room, slots_for) for req in reqs]
        if not any(c.tokens for c in cands):
            self._idle(reqs, cands)
            return None
        counts = plan(len(reqs), [c.values for c in cands], self.costs)
        drafts: list[DraftTree] = []
        for req, d, c in zip(reqs, cands, counts, strict=True):
            while c and slots_for(req, c) > room:
                c -= 1
            room -= slots_for(req, c) if c else 0
            drafts.append(d.prefix(c))
        self._idle(reqs, drafts)
        return drafts if any(d.tokens for d in drafts) else None

    def draft_one(self, req: Req, room: int, slots_for: Callable[[Req, int], int], batch_tokens: int) -> DraftTree:
        """``draft`` for one request of a step that has ``batch_tokens`` tokens without it (the
        unified scheduler decides request by request)."""
        d = self.candidate(req, room, slots_for)
        if d.tokens:
            d = d.prefix(plan(batch_tokens, [d.values], self.costs)[0])
        self._idle([req], [d])
        return d

    def candidate(self, req: Req, room: int, slots_for: Callable[[Req, int], int]) -> DraftTree:
        """``req``'s proposal: at most ``--speculative-num-draft-tokens``, none past
        ``max_new_tokens`` (the target's own token counts) and within ``room``; empty for a request
        that cannot draft. A request under a grammar drafts a chain (its matcher follows one path)."""
        none = DraftTree([], [], [])
        if room <= 0 or not can_draft(req):
            return none
        st = req.spec
        if st is None:
            st = req.spec = NgramDrafts(req, self.min_n, self.max_n, self.match_alpha)
        k = min(self.max_k, req.sampling_params.max_new_tokens - len(req.output_ids) - 1)
        if k <= 0:
            return none
        if self.by_runner:
            d = DraftTree([DRAFT_BY_RUNNER] * k, list(range(-1, k - 1)), chain_values(st.alpha, k))
        else:
            st.sync(req)
            d = st.propose_tree(k, 1 if req.grammar is not None else self.breadth)
        n = len(d.tokens)
        while n and slots_for(req, n) > room:
            n -= 1
        return d.prefix(n)

    @staticmethod
    def _idle(reqs: list[Req], drafts: list[DraftTree]) -> None:
        for req, d in zip(reqs, drafts, strict=True):
            if not d.tokens and req.spec is not None:
                req.spec.idle()

    def accept(self, batch: ScheduleBatch, out: ForwardOutput,
               keep_path: Callable[[Req, int, list[int]], None]) -> dict[int, list[int]]:
        """Row -> the tokens a verify row keeps: its drafts while the target agreed (a tree row: the
        path the runner walked), then the target's token (at most ``k + 1``). ``keep_path(req,
        first, path)`` moves a tree row's kept drafts' KV slots, from its ``first`` draft on, to the
        positions they are kept at. Updates each request's acceptance and the counters."""
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
        parents = batch.draft_parents
        if parents is not None and (out.verify_paths is None or len(out.verify_paths) != len(rows)):
            raise RuntimeError("the runner returned no paths for a step with draft trees")
        kept: dict[int, list[int]] = {}
        s = self.stats
        s.verify_steps += 1
        for j, (i, t) in enumerate(zip(rows, verified, strict=True)):
            d = drafts[i]
            path = out.verify_paths[j] if parents is not None and out.verify_paths is not None else None
            line = [d[n] for n in path] if path is not None else d
            a = 0
            while a < len(line) and t[a] == line[a]:
                a += 1
            req = batch.reqs[i]
            if parents is not None and parents[i] is not None:
                s.tree_rows += 1
            if path is not None and path[:a] != list(range(a)):
                keep_path(req, batch.prefix_lens[i] + 1, path[:a])
                s.side_paths += 1
            kept[i] = [x for x in t[: a + 1] if x >= 0]  # -1: past where a grammar ended the row
            req.spec_verify_ct += 1
            req.spec_accepted_tokens += a
            s.verify_rows += 1
            s.draft_tokens += len(d)
            s.accepted_tokens += a
            if req.spec is not None:  # a failure where the walk stopped at a node with drafts under it
                tree = parents[i] if parents is not None else None
                end = path[a - 1] if tree is not None and path and a else -1
                refused = (end in tree) if tree is not None else a < len(d)
                req.spec.update(a + refused, a)
        return kept


def attach_drafts(batch: ScheduleBatch, drafts: list[DraftTree], grow: Callable[[Req, int], list[int]]) -> None:
    """Turn a built decode step (one token and one slot per row, ``out_slots`` in row order) into
    one that also carries ``drafts``: each drafting row extends by ``1 + k``, with the slots that
    ``grow`` takes for its drafts right after its own (in the drafts' order)."""
    flat: list[int] = []
    for i, (req, d, slot) in enumerate(zip(batch.reqs, drafts, batch.out_slots, strict=True)):
        flat.append(slot)
        if d.tokens:
            flat.extend(grow(req, len(d.tokens)))
            batch.extend_lens[i] = 1 + len(d.tokens)
    batch.out_slots = flat
    set_drafts(batch, drafts)


def set_drafts(batch: ScheduleBatch, drafts: list[DraftTree]) -> None:
    """``batch.drafts`` and, where a row's drafts branch, ``batch.draft_parents``."""
    batch.drafts = [d.tokens for d in drafts]
    trees = [d.parents if d.tokens and not is_chain(d.parents) else None for d in drafts]
    batch.draft_parents = trees if any(p is not None for p in trees) else None
