"""Decode attention for requests that share a cached prefix: read the shared KV once per group.

When the radix cache hands several running requests the same prefix, their ``req_to_token`` rows
hold the very same KV slots for those positions. Plain decode attention gathers that prefix once
per request; on this CPU the gather (memory traffic), not the arithmetic, is what a decode step
pays for (batch 128 x 640 tokens: ~470 of ~720 ms per step). Here a group's prefix is gathered once
and its queries attend to it in one GEMM (``[KVH, n*G, D] x [KVH, D, P]``); each request's own
suffix is attended separately, and the two partial softmaxes are merged with their log-sum-exp
terms, which gives exactly softmax attention over the whole sequence.

``find_shared_prefixes`` finds the groups from the slot table alone (no scheduler state), so any
caller that shares slots (radix cache hits, forks) benefits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# A group is worth a separate path when it saves at least this many gathered tokens per layer;
# below it the extra small ops cost more than the copy they avoid.
MIN_SAVED_TOKENS = 256
MIN_PREFIX_TOKENS = 32


@dataclass
class SharedPrefixGroup:
    """Decode requests whose first ``prefix_len`` KV slots are the same."""

    members: list[int]  # their positions in the caller's list of decode requests
    prefix_slots: torch.Tensor  # [P] the shared KV slots
    suffix_gather: torch.Tensor  # [n * Ls] each request's own slots after the prefix, 0-padded
    suffix_len: int  # Ls: the longest suffix (the new token included)
    suffix_mask: torch.Tensor | None  # [n, 1, 1, Ls] additive mask over the padding; None: no padding

    @property
    def prefix_len(self) -> int:
        return int(self.prefix_slots.numel())


def find_shared_prefixes(
    r2t: torch.Tensor,
    rows_rpi: list[int],
    lens: list[int],
    min_prefix: int = MIN_PREFIX_TOKENS,
    min_saved: int = MIN_SAVED_TOKENS,
) -> list[tuple[list[int], int]]:
    """Groups of decode requests (positions into ``rows_rpi``) with the length of their common
    prefix of KV slots. ``lens[i]`` counts request ``i``'s tokens including the new one, which is
    never part of a shared prefix. A group whose common prefix is too short is split by the slot
    at the first position where its members differ, so nested sharing (a common chat-template
    head, then one system prompt per group) is found at the deepest useful level."""
    by_first: dict[int, list[int]] = {}
    firsts = r2t[torch.tensor(rows_rpi, dtype=torch.int64), 0].tolist() if rows_rpi else []
    for i, s in enumerate(firsts):
        if lens[i] > 1:
            by_first.setdefault(int(s), []).append(i)
    found: list[tuple[list[int], int]] = []
    work = [(members, 1) for members in by_first.values()]
    while work:
        members, known = work.pop()  # members agree on the first `known` slots
        if len(members) < 2:
            continue
        limit = min(lens[i] for i in members) - 1  # the new tokens are never shared
        if limit <= known:
            continue
        sub = r2t.index_select(0, torch.tensor([rows_rpi[i] for i in members], dtype=torch.int64))[:, :limit]
        same = (sub == sub[:1]).all(0)
        p = limit if bool(same.all()) else int(same.to(torch.int8).argmin())
        if p >= min_prefix and (len(members) - 1) * p >= min_saved:
            found.append((members, p))
        elif p < limit:
            split: dict[int, list[int]] = {}
            for m, s in zip(members, sub[:, p].tolist(), strict=True):
                split.setdefault(int(s), []).append(m)
            work.extend((g, p + 1) for g in split.values())
    return found


def build_group(
    r2t: torch.Tensor, rows_rpi: list[int], lens: list[int], members: list[int], prefix_len: int,
    dtype: torch.dtype = torch.float32,
) -> SharedPrefixGroup:
    first = rows_rpi[members[0]]
    prefix_slots = r2t[first, :prefix_len].clone()
    suf = [lens[i] - prefix_len for i in members]
    Ls = max(suf)
    rows = r2t.index_select(0, torch.tensor([rows_rpi[i] for i in members], dtype=torch.int64))
    gather = rows[:, prefix_len : prefix_len + Ls]
    mask = None
    if min(suf) != Ls:
        keep = torch.arange(Ls).unsqueeze(0) < torch.tensor(suf).unsqueeze(1)
        gather = gather.masked_fill(~keep, 0)
        mask = torch.zeros(len(members), 1, 1, Ls, dtype=dtype).masked_fill_(~keep.view(-1, 1, 1, Ls), float("-inf"))
    return SharedPrefixGroup(members, prefix_slots, gather.reshape(-1).contiguous(), Ls, mask)


def attend_shared(
    q: torch.Tensor, grp: SharedPrefixGroup, read: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    scale: float,
) -> torch.Tensor:
    """``q: [n, KVH, G, D]`` (the G query heads of a KV head as rows) -> ``[n, KVH * G * D]``.
    ``read(slots)``: the K and V rows of ``slots`` in ``q``'s dtype (``KVPool.read`` of the layer)."""
    n, KVH, G, D = q.shape
    Ls = grp.suffix_len
    dt = q.dtype
    # shared prefix: one gather, one GEMM for all n*G query rows of each KV head
    kp, vp = read(grp.prefix_slots)  # [P, KVH, D]
    qh = q.permute(1, 0, 2, 3).reshape(KVH, n * G, D)
    s1 = torch.bmm(qh, kp.permute(1, 2, 0)).mul_(scale)  # [KVH, nG, P]
    m1 = s1.amax(-1, keepdim=True)
    p1 = s1.sub_(m1).exp_()
    l1 = p1.sum(-1, keepdim=True)
    o1 = torch.bmm(p1, vp.transpose(0, 1))  # [KVH, nG, D]
    o1 = o1.view(KVH, n, G, D).transpose(0, 1)  # [n, KVH, G, D]
    m1 = m1.view(KVH, n, G, 1).transpose(0, 1)
    l1 = l1.view(KVH, n, G, 1).transpose(0, 1)
    # each request's own tokens after the prefix (its new token included)
    ks, vs = read(grp.suffix_gather)
    ks, vs = ks.view(n, Ls, KVH, D), vs.view(n, Ls, KVH, D)
    s2 = torch.matmul(q, ks.permute(0, 2, 3, 1)).mul_(scale)  # [n, KVH, G, Ls]
    if grp.suffix_mask is not None:
        s2.add_(grp.suffix_mask.to(dt))
    m2 = s2.amax(-1, keepdim=True)
    p2 = s2.sub_(m2).exp_()
    l2 = p2.sum(-1, keepdim=True)
    o2 = torch.matmul(p2, vs.transpose(1, 2))  # [n, KVH, G, D]
    # merge the two partial softmaxes
    m = torch.maximum(m1, m2)
    a1 = (m1 - m).exp_()
    a2 = (m2 - m).exp_()
    out = (o1 * a1 + o2 * a2) / (l1 * a1 + l2 * a2)
    return out.reshape(n, KVH * G * D)
