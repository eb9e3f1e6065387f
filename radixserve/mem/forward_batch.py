"""The one description of a model step that every scheduler produces and every runner consumes.

A ``ForwardBatch`` is a flat list of new tokens plus, per request, how long its cached prefix is
and how many new tokens it extends by. Prefill is an extend with a short (or empty) prefix, decode
is an extend of length one, and mixed batches are just both at once: the runner never learns
which scheduler or which phase built the batch.

NOTE: it lives in ``mem`` because it is, at heart, a map of KV slots to write and read, and both
``sched`` (which builds it) and ``model`` (which consumes it) may import ``mem``.

Layout of one batch with two requests, A (prefix 3, extend 2) and B (decode, prefix 5)::

    input_ids      [a3 a4 | b5]        flat, T = sum(extend_seq_lens) = 3
    positions      [ 3  4 |  5]
    out_cache_loc  [s  s  |  s]        KV slot each new token's K/V is written to
    req_pool_indices [rA, rB]          rows of ReqToTokenPool.req_to_token
    seq_lens         [ 5,  6]          prefix + extend: KV the attention reads per request
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from radixserve.mem.penalties import RowPenalties


def int64_tensor(values: Iterable[int]) -> torch.Tensor:
    """``torch.tensor(values, dtype=torch.int64)`` (a CPU tensor) for ints, about 3.5x faster for a
    thousand of them (16 against 60 us): ``array("q")`` packs them in C and the tensor wraps its
    buffer without a copy (the tensor keeps the array alive). Built every step for every request."""
    a = array("q", values)
    return torch.frombuffer(a, dtype=torch.int64) if a else torch.empty(0, dtype=torch.int64)


@dataclass
class SamplingBatchInfo:
    """Per-request sampling parameters, one entry per request in batch order."""

    temperatures: list[float]
    top_ps: list[float]
    top_ks: list[int]  # -1 (or <= 0) disables top-k
    min_ps: list[float]
    seeds: list[int | None]  # None: draw from the runner's global generator
    steps: list[int]  # tokens generated so far; with a seed, makes sampling batch-independent
    return_logprob: list[bool] = field(default_factory=list)
    top_logprobs_nums: list[int] = field(default_factory=list)
    # per request, its penalties or None; None: no request in the batch has any (the sampler's fast path)
    penalties: list[RowPenalties | None] | None = None
    input_ids: torch.Tensor | None = None  # with penalties: the forward's input ids (pending tokens)
    # per request, the grammar matcher that constrains the token it samples now (radixserve.grammar),
    # or None; None: no request in the batch samples under a grammar this step
    grammars: list[Any | None] | None = None

    @property
    def is_all_greedy(self) -> bool:
        return all(t <= 1e-6 for t in self.temperatures) or all(k == 1 for k in self.top_ks)

    @classmethod
    def greedy(cls, n: int) -> SamplingBatchInfo:
        return cls([0.0] * n, [1.0] * n, [-1] * n, [0.0] * n, [None] * n, [0] * n)


@dataclass
class PromptLogprobRows:
    """Prompt positions whose next token's log-probability a request asked for (``echo`` with
    ``logprobs``, SGLang's ``logprob_start_len``): the model computes logits at these positions too,
    after each request's last one. Entry ``k`` is the flat token ``positions[k]`` of batch row
    ``rows[k]``; the prompt token that follows it is ``targets[k]``, at index ``token_index[k]``."""

    positions: list[int]
    rows: list[int] = field(default_factory=list)
    targets: list[int] = field(default_factory=list)
    token_index: list[int] = field(default_factory=list)
    top_n: list[int] = field(default_factory=list)


@dataclass
class VerifyRows:
    """Speculative decoding: batch rows whose extend is the request's last token followed by draft
    tokens. Row ``rows[k]`` drafted ``drafts[k]``; the model computes logits at the row's positions
    before its last one too (flat ``positions``, every row's drafts in order, after each request's
    last position and the prompt logprob positions), and the runner returns, per row, the token the
    target model puts at each of its ``len(draft) + 1`` positions (``ForwardOutput.verified``)."""

    rows: list[int]
    drafts: list[list[int]]
    positions: list[int]
    # the drafts are for the runner to make (a draft model): ``drafts`` holds placeholders of the
    # lengths the scheduler asked for, and the rows' input ids there are filled in before the forward
    by_runner: bool = False
    # per row, its drafts' parents (mem/draft_tree.py): a row's drafts form a tree, each attended
    # as the decode row of its own path; None: every row is a chain
    parents: list[list[int]] | None = None


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64
    req_pool_indices: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64, prefix + extend
    extend_prefix_lens: list[int]  # [B]
    extend_seq_lens: list[int]  # [B]
    sampling: SamplingBatchInfo
    capture_logits: bool = False  # return each request's last-position logits (tests, parity)
    rids: list[str] = field(default_factory=list)  # [B] request ids, for runners that model requests (the simulator)
    prompt_logprobs: PromptLogprobRows | None = None  # None: no request wants prompt logprobs this step
    verify: VerifyRows | None = None  # None: no draft tokens in this step

    def extra_logit_positions(self) -> list[int]:
        """Flat positions whose logits the model computes after each request's last one: the
        prompt logprob positions, then the draft verification positions."""
        extra = list(self.prompt_logprobs.positions) if self.prompt_logprobs is not None else []
        if self.verify is not None:
            extra.extend(self.verify.positions)
        return extra

    @property
    def batch_size(self) -> int:
        return len(self.extend_seq_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.extend_seq_lens)


@dataclass
class ForwardOutput:
    next_token_ids: list[int]  # one sampled token per request
    logprobs: list[float] | None = None  # log-probability of the sampled token, where asked
    top_logprobs: list[list[tuple[int, float]]] | None = None
    logits: torch.Tensor | None = None  # [B, vocab] float32 when capture_logits
    # rows whose grammar ended with the token sampled now: "" complete (only EOS may follow), else
    # the matcher's error; None: no grammar ended
    grammar_ended: dict[int, str] | None = None
    prompt_logprobs: PromptLogprobs | None = None  # what ``ForwardBatch.prompt_logprobs`` asked for
    # per ``ForwardBatch.verify`` row: the target's token at each of its positions (greedy: the
    # argmax; sampled: the draft token where rejection sampling accepted it, else a draw from the
    # residual distribution, which never equals the draft). The scheduler keeps drafts while they
    # equal these, then the first token that differs (or the one after the last draft).
    verified: list[list[int]] | None = None
    drafts: list[list[int]] | None = None  # per verify row, the drafts the runner made (``VerifyRows.by_runner``)
    # per verify row when ``VerifyRows.parents`` is set: the drafts it kept, a path down its tree;
    # ``verified`` then holds the target's tokens along that path (the last one after it)
    verify_paths: list[list[int]] | None = None
    # per verify row and position, the log-probability of ``verified``'s token and the top ones, as
    # ``logprobs`` / ``top_logprobs`` are for a decode row (present when those are)
    verified_logprobs: list[list[float]] | None = None
    verified_top_logprobs: list[list[list[tuple[int, float]]]] | None = None


@dataclass
class PromptLogprobs:
    """Per entry of ``rows``: the target token's log-probability and the position's top ``top_n``
    (token, logprob) pairs."""

    rows: PromptLogprobRows
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]


class Runner(Protocol):
    """What the scheduler needs from a model: one forward over a ForwardBatch.

    The real ``ModelRunner``, the simulator's cost-model runner and test doubles all fit.
    """

    def forward(self, batch: ForwardBatch) -> ForwardOutput: ...
