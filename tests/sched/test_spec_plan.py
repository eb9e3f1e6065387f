"""Speculative decoding's pieces alone: the n-gram drafter (longest then latest match, acceptance
learned by match length and shared), the step-cost estimates and the plan that trades expected
tokens against a step's cost."""

from __future__ import annotations

from radixserve.sched.spec import StepCosts, chain_values, plan
from radixserve.sched.spec_ngram import NgramDrafts, match_class

# --- the n-gram drafter ------------------------------------------------------------------

class _Req:
    def __init__(self, prompt: list[int]) -> None:
        self.origin_input_ids = prompt
        self.output_ids: list[int] = []

    @property
    def prompt_len(self) -> int:
        return len(self.origin_input_ids)


def test_ngram_prefers_the_longest_match_then_the_latest() -> None:
    req = _Req([1, 2, 3, 9, 8, 5, 2, 3, 7, 6, 4, 2, 3])
    d = NgramDrafts(req, 1, 4)  # type: ignore[arg-type]
    d.sync(req)  # type: ignore[arg-type]
    # suffix (2, 3): matched after positions 1-2 (then 9) and 6-7 (then 7); longer matches: (4? no) ->
    # both match 2 tokens; the latest wins
    assert d.propose(3) == [7, 6, 4]
    req.output_ids = [9]  # suffix ..., 2, 3, 9: matches 1, 2, 3, 9 at the start -> what followed: 8, 5
    d.sync(req)  # type: ignore[arg-type]
    assert d.propose(2) == [8, 5]


def test_ngram_tree_follows_the_next_best_matches() -> None:
    """The suffix 1 2 occurred twice, followed by 9? 5 6 .. (a 3-token match) and by 3 4 .. (2
    tokens): the tree holds both continuations, ordered by their chance of being kept, so that any
    prefix of its nodes is a tree."""
    req = _Req([1, 2, 3, 4, 9, 1, 2, 5, 6, 9, 1, 2])
    d = NgramDrafts(req, 2, 4)  # type: ignore[arg-type]
    d.sync(req)  # type: ignore[arg-type]
    assert d.propose_tree(7, 1).tokens == [5, 6, 9, 1, 2] == d.propose(7)
    tree = d.propose_tree(7, 2)
    # 5 6 9 1 (the long match's, 0.6 each), then 3 (2-token match, 0.2, and only if 5 fails: x 0.4)
    assert tree.tokens == [5, 6, 9, 1, 3, 2, 4]
    assert tree.parents == [-1, 0, 1, 2, -1, 3, 4]
    assert tree.values == sorted(tree.values, reverse=True)
    assert d.propose_tree(3, 2).tokens == [5, 6, 9]  # the budget is in tokens, the best branch first


def test_ngram_no_match_no_draft() -> None:
    req = _Req(list(range(1, 30)))
    d = NgramDrafts(req, 2, 5)  # type: ignore[arg-type]
    d.sync(req)  # type: ignore[arg-type]
    assert d.propose(4) == []


def test_acceptance_estimate() -> None:
    d = NgramDrafts(_Req([1]), 1, 2)  # type: ignore[arg-type]
    a0 = d.alpha
    d.update(4, 4)
    assert d.alpha > a0
    for _ in range(10):
        d.update(3, 0)
    low = d.alpha
    assert low < 0.05
    for _ in range(50):
        d.idle()
    assert low < d.alpha < a0


def test_acceptance_is_kept_by_match_length_and_shared() -> None:
    """A one-token match and a long one are different bets: their acceptance is learned apart, and
    what one request learned is where the next one starts."""
    shared = [0.6, 0.6, 0.6]
    req = _Req([5, 6, 7, 8, 9, 1, 2, 3, 4, 5, 6, 7, 8])  # suffix 5 6 7 8 matched at the start: long
    d = NgramDrafts(req, 1, 12, shared)  # type: ignore[arg-type]
    d.sync(req)  # type: ignore[arg-type]
    assert d.propose(3) == [9, 1, 2] and d.cls == match_class(4) == 1
    for _ in range(20):
        d.update(3, 3)
    long_alpha = d.alpha
    req.output_ids = [42, 2]  # suffix ... 42, 2: only "2" matches (one token)
    d.sync(req)  # type: ignore[arg-type]
    assert d.propose(3) == [3, 4, 5] and d.cls == 0
    for _ in range(20):
        d.update(3, 0)
    assert d.alpha < 0.1 < 0.9 < long_alpha
    assert shared[0] < 0.6 < shared[1]  # every request's starting point moved with them
    other = NgramDrafts(_Req([1]), 1, 12, shared)  # type: ignore[arg-type]
    assert other.alphas == shared and other.alphas is not shared


def costs(table: dict[int, float]) -> StepCosts:
    c = StepCosts()
    c.seconds = dict(table)
    return c


def test_plan_follows_acceptance_and_the_cost_curve() -> None:
    # a CPU's row kernels work 4 rows at a time: 5 tokens cost a lot more than 4
    blocky = costs({1: 20.0, 2: 26.0, 3: 29.0, 4: 28.0, 5: 40.0, 8: 47.0, 9: 50.0, 16: 72.0})
    assert plan(1, [chain_values(0.7, 8)], blocky) == [3]  # stops where the next block starts
    assert plan(1, [chain_values(0.95, 8)], blocky) == [8]  # unless most of a longer draft is likely kept
    assert plan(1, [chain_values(0.1, 8)], blocky) == [0]  # unlikely drafts are not worth a bigger step
    flat = costs({1: 20.0, 9: 21.0})
    assert plan(1, [chain_values(0.95, 8)], flat) == [8]
    # a batch: the surest tokens first
    batch = costs({4: 40.0, 5: 41.0, 6: 42.0, 7: 50.0, 8: 70.0, 12: 120.0})
    assert plan(4, [chain_values(0.9, 4), chain_values(0.2, 4), [], chain_values(0.85, 4)], batch) == [1, 0, 0, 1]
    assert plan(4, [chain_values(0.9, 4)], StepCosts()) == [0]  # nothing measured yet


def test_step_cost_estimates() -> None:
    c = costs({2: 10.0, 6: 18.0})
    assert c.cost(4) == 14.0 and c.cost(6) == 18.0
    assert 18.0 < c.cost(8) < 18.0 * 8 / 6  # past the largest: cheaper per token than measured (tried once)
    assert c.cost(1) == 5.0
    c.observe(4, 20.0)
    assert c.cost(4) == 20.0
    c.observe(4, 10.0)
    assert 10.0 < c.cost(4) < 20.0
