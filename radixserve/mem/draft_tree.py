"""The shape of a request's draft tokens in a speculative verify step: a tree over its last token.

A request verifies ``k`` draft tokens after its last token ``d_0``. They form a tree rooted at
``d_0``: ``parents[j]`` is the draft that draft ``j`` follows (``-1``: ``d_0`` itself), always an
earlier index, so the drafts are in an order where a parent comes before its children. A chain
(each draft follows the one before: ``[-1, 0, 1, ..]``) is the common case, and ``None`` stands
for it wherever parents are optional.

In the verify step the row's flat tokens are ``d_0`` and then the drafts in this order; draft
``j`` sits at position ``p + depth(j)`` (``p``: ``d_0``'s position, ``depth`` 1 for ``d_0``'s
children) and attends ``d_0``'s prefix, ``d_0``, and its own ancestors: exactly the decode row it
would be if its path had been decoded one token at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def chain(k: int) -> list[int]:
    """The parents of ``k`` drafts in a chain."""
    return list(range(-1, k - 1))


def is_chain(parents: Sequence[int]) -> bool:
    return all(p == j - 1 for j, p in enumerate(parents))


def depths(parents: Sequence[int]) -> list[int]:
    """Each draft's depth below the last token (its children: 1)."""
    out: list[int] = []
    for j, p in enumerate(parents):
        if not -1 <= p < j:
            raise ValueError(f"draft {j}'s parent {p} does not come before it")
        out.append(1 if p < 0 else out[p] + 1)
    return out


def path_to(parents: Sequence[int], j: int) -> list[int]:
    """Draft ``j``'s ancestors and itself, from the one below the last token down (``j == -1``: [])."""
    path: list[int] = []
    while j >= 0:
        path.append(j)
        j = parents[j]
    path.reverse()
    return path


def children(parents: Sequence[int]) -> list[list[int]]:
    """Entry ``j + 1``: draft ``j``'s children in order (entry 0: the last token's)."""
    out: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for j, p in enumerate(parents):
        out[p + 1].append(j)
    return out


def walk(parents: Sequence[int], draft: Sequence[int],
         token_at: Callable[[int, list[int]], int]) -> tuple[list[int], list[int]]:
    """Verification's walk down the tree: ``token_at(j, candidates)`` is the target's token at row
    ``j`` (0: after the last token, ``c + 1``: after draft ``c``), whose children are the drafts
    ``candidates``; where it is one of them the walk goes on there. Returns the target's tokens
    along the walk and the drafts walked into (the kept ones)."""
    kids = children(parents)
    tokens: list[int] = []
    path: list[int] = []
    j = 0
    while True:
        tok = token_at(j, kids[j])
        tokens.append(tok)
        nxt = next((c for c in kids[j] if draft[c] == tok), None)
        if nxt is None:
            return tokens, path
        path.append(nxt)
        j = nxt + 1
