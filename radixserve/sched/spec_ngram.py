"""N-gram drafts (prompt lookup) for speculative decoding, and the acceptance they have earned.

A request's tokens (prompt and output) are indexed by ``min_n``-gram. Its draft is what followed
earlier occurrences of its current suffix: the longest match (up to ``max_n`` tokens, the latest
on a tie) first. With a breadth above one, the next best matches whose continuations differ are
verified in the same step as branches of a tree (``mem/draft_tree.py``): where the text repeats
with variations (a list whose items start alike, code with similar lines), the branch the model
takes is often the second one.

A draft's acceptance is learned by its match class (how long the suffix it was found by: a
one-token match is a guess, a twelve-token one mostly a quotation), per request and shared over
all requests, which a request starts from and drifts back to while idle.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.sched.req import Req

_CANDIDATES = 8  # earlier occurrences of the match key looked at per draft, the latest first
EMA = 0.3  # weight of the latest measurement in a request's acceptance (and in a step cost)
_RECOVER = 0.02  # how fast an idle request's acceptance returns to the prior, per step
_SHARED_EMA = 0.05  # weight of one verify in the acceptance all requests share, per match class
# A draft's match class: how long the suffix it was found by (a one-token match is a guess, a
# twelve-token one mostly a quotation). Measured on the grounded workload: matches of 1-2 tokens
# kept 6-23% of their drafts, 3-5 tokens 55-100%, 6 or more ~70%.
_MATCH_CLASSES = (3, 6)  # the shortest match of the medium and of the long class
_CLASS_PRIORS = (0.2, 0.6, 0.7)  # the acceptance of each class before any request has verified


def match_class(length: int) -> int:
    return sum(length >= b for b in _MATCH_CLASSES)


@dataclass
class DraftTree:
    """A request's proposal: draft tokens, each one's parent (``mem/draft_tree.py``) and its
    estimated chance of being kept, in an order where a parent comes before its children."""

    tokens: list[int]
    parents: list[int]
    values: list[float]

    def by_value(self) -> DraftTree:
        """The same tree with its nodes in order of value (a parent's value is never below its
        children's, and comes first on a tie): every prefix of the order is a tree."""
        order = sorted(range(len(self.tokens)), key=lambda j: (-self.values[j], j))
        where = {j: i for i, j in enumerate(order)}
        return DraftTree([self.tokens[j] for j in order],
                         [where[self.parents[j]] if self.parents[j] >= 0 else -1 for j in order],
                         [self.values[j] for j in order])

    def prefix(self, n: int) -> DraftTree:
        return DraftTree(self.tokens[:n], self.parents[:n], self.values[:n])


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

    def _matches(self) -> list[tuple[int, int]]:
        """``(match length, position)`` of the earlier occurrences of the current suffix (the latest
        ``_CANDIDATES`` of its ``min_n``-gram), longest first, then latest."""
        tokens, n = self.tokens, self.min_n
        L = len(tokens)
        hits = self.index.get(tuple(tokens[L - n :])) if L > n else None
        if not hits:
            return []
        found = []
        for p in hits[-_CANDIDATES:]:
            m = n
            while m < self.max_n and p - m - 1 >= 0 and tokens[p - m - 1] == tokens[L - m - 1]:
                m += 1
            found.append((m, p))
        found.sort(key=lambda h: (-h[0], -h[1]))
        return found

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest earlier match of the current suffix."""
        return self.propose_tree(k, 1).tokens

    def propose_tree(self, k: int, breadth: int) -> DraftTree:
        """Up to ``k`` draft tokens as a tree of at most ``breadth`` branches: what followed each of
        the best earlier matches (longest, then latest; up to ``k`` tokens each), continuations that
        agree sharing their nodes, and of those the ``k`` most likely kept. Each node's value is
        its estimated chance of being kept: ``alpha ** depth`` along the best match's branch; a
        later branch's node where it leaves a shared node is worth that node's value times the
        chance the earlier branch fails there times its own acceptance."""
        tree = DraftTree([], [], [])
        matches = self._matches() if k > 0 else []
        if not matches:
            return tree
        self.cls = match_class(matches[0][0])
        first_alpha = self.alphas[self.cls]
        kids: dict[tuple[int, int], int] = {}  # (parent, token) -> node
        branches = 0
        for m, p in matches:
            alpha = self.alphas[match_class(m)]
            node, grew = -1, False
            for t in self.tokens[p : p + k]:
                child = kids.get((node, t))
                if child is None:
                    up = tree.values[node] if node >= 0 else 1.0
                    shared = any(q == node for q in tree.parents)  # another branch already continues here
                    value = up * alpha * ((1 - first_alpha) if shared else 1.0)
                    child = kids[(node, t)] = len(tree.tokens)
                    tree.tokens.append(t)
                    tree.parents.append(node)
                    tree.values.append(value)
                    grew = True
                node = child
            branches += grew
            if branches >= breadth:
                break
        return tree.by_value().prefix(k)

    def update(self, drafted: int, accepted: int) -> None:
        """After a verify step: ``accepted`` of ``drafted`` tokens kept (each kept draft a success,
        the first rejected one a failure)."""
        trials = accepted + (accepted < drafted)
        rate, c = accepted / trials, self.cls
        self.alphas[c] = (1 - EMA) * self.alphas[c] + EMA * rate
        self.shared[c] = (1 - _SHARED_EMA) * self.shared[c] + _SHARED_EMA * rate

    def idle(self) -> None:
        """A step without drafts: the estimates drift back towards the shared ones, so a request
        whose early drafts failed is tried again later (its text may have turned repetitive)."""
        for c, a in enumerate(self.alphas):
            self.alphas[c] = a + _RECOVER * (self.shared[c] - a)
