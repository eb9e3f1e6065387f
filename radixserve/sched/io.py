"""What the scheduler emits: one ``BatchOut`` per step, a column per field and a row per request
that has news (a token of a streaming request, its first token, its finish; ``Req.stream``).

The same record goes the whole way: the scheduler fills it, msgpack carries it over ZeroMQ to the
detokenizer, which fills the ``texts`` column (merging rows under ``--stream-interval``) and
passes it on to the HTTP process. ``Engine`` reads it in process. Columns keep the per-step cost
low at a thousand running requests: appending to a few lists per row, no object per row, one
encode per step.

    rids               ["a",      "b",        "c"]
    token_ids          [[17],     [5, 9],     []]
    finished_reasons   [None,     FINISH_LENGTH(2), FINISH_ABORT(...)]
    ...                one entry per row in every column
    detok_params       [DetokParams("a", ...)]     only a request's first row (sparse)
    input_logprobs     [InputLogprobsOut("b", ...)] prompt logprobs, with the first row (sparse)
    texts              []  ->  ["x", "yz", ""]     filled by the detokenizer

A row is read through ``OutRow`` (``batch[i]`` or iterating the batch), whose attribute names are
the fields' singular names (``rid``, ``new_token_ids``, ``finished_reason``, ``text``...).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import msgspec

from radixserve.sched.finish import FinishReason

NO_LOGPROBS: list[float] = []  # shared by rows without logprobs: never appended to
NO_TOP_LOGPROBS: list[list[tuple[int, float]]] = []


class DetokParams(msgspec.Struct, array_like=True):
    """How the detokenizer turns a request's tokens into text; sent with the request's first row."""

    rid: str
    stop: list[str]
    skip_special_tokens: bool = True


class InputLogprobsOut(msgspec.Struct, array_like=True):
    """A request's prompt logprobs (``Req.input_logprobs``), sent with its first row: entry ``k`` is
    prompt token ``start + k``'s (None for token 0); ``token_ids`` are those tokens."""

    rid: str
    start: int
    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]


class BatchOut(msgspec.Struct, tag=True):
    rids: list[str] = []
    token_ids: list[list[int]] = []  # the row's new tokens
    finished_reasons: list[FinishReason | None] = []
    prompt_tokens: list[int] = []
    completion_tokens: list[int] = []  # output tokens so far
    cached_tokens: list[int] = []
    logprobs: list[list[float]] = []  # of the new tokens ([] when the request asked for none)
    top_logprobs: list[list[list[tuple[int, float]]]] = []
    queue_times: list[float] = []  # arrival -> first scheduled
    num_retractions: list[int] = []
    detok_params: list[DetokParams] = []
    input_logprobs: list[InputLogprobsOut] = []  # sparse, like detok_params
    # speculative decoding, sparse: rid -> (verify steps that carried its drafts, drafts accepted)
    spec: dict[str, tuple[int, int]] = {}
    texts: list[str] = []  # the new text that is safe to show (the detokenizer's column)
    dp_rank: int = 0  # the data-parallel rank that ran these requests

    def add(
        self, rid: str, token_ids: list[int], reason: FinishReason | None, prompt_tokens: int,
        completion_tokens: int, cached_tokens: int, logprobs: list[float] = NO_LOGPROBS,
        top_logprobs: list[list[tuple[int, float]]] = NO_TOP_LOGPROBS, queue_time: float = 0.0, num_retractions: int = 0,
    ) -> None:
        self.rids.append(rid)
        self.token_ids.append(token_ids)
        self.finished_reasons.append(reason)
        self.prompt_tokens.append(prompt_tokens)
        self.completion_tokens.append(completion_tokens)
        self.cached_tokens.append(cached_tokens)
        self.logprobs.append(logprobs)
        self.top_logprobs.append(top_logprobs)
        self.queue_times.append(queue_time)
        self.num_retractions.append(num_retractions)

    def add_row(self, o: OutRow, token_ids: Sequence[int], logprobs: list[float],
                top_logprobs: list[list[tuple[int, float]]], text: str) -> None:
        """Row ``o`` of another batch with its tokens (and text) replaced: a merged streaming row."""
        self.add(o.rid, list(token_ids), o.finished_reason, o.prompt_tokens, o.completion_tokens, o.cached_tokens,
                 logprobs, top_logprobs, o.queue_time, o.num_retractions)
        self.texts.append(text)
        if o.spec is not None:
            self.spec[o.rid] = o.spec

    def extend(self, other: BatchOut) -> None:
        """Append ``other``'s rows (texts only when both have them)."""
        for name in _COLUMNS:
            getattr(self, name).extend(getattr(other, name))
        self.detok_params.extend(other.detok_params)
        self.input_logprobs.extend(other.input_logprobs)
        self.spec.update(other.spec)
        if len(self.texts) + len(other.texts) == len(self.rids):
            self.texts.extend(other.texts)

    def __len__(self) -> int:
        return len(self.rids)

    def __getitem__(self, i: int) -> OutRow:
        if not -len(self.rids) <= i < len(self.rids):
            raise IndexError(i)
        return OutRow(self, i % len(self.rids))

    def __iter__(self) -> Iterator[OutRow]:
        return (OutRow(self, i) for i in range(len(self.rids)))


_COLUMNS = ("rids", "token_ids", "finished_reasons", "prompt_tokens", "completion_tokens", "cached_tokens",
            "logprobs", "top_logprobs", "queue_times", "num_retractions")


class OutRow:
    """One row of a ``BatchOut``, read in place."""

    __slots__ = ("batch", "i")

    def __init__(self, batch: BatchOut, i: int) -> None:
        self.batch = batch
        self.i = i

    @property
    def rid(self) -> str:
        return self.batch.rids[self.i]

    @property
    def new_token_ids(self) -> list[int]:
        return self.batch.token_ids[self.i]

    @property
    def finished_reason(self) -> FinishReason | None:
        return self.batch.finished_reasons[self.i]

    @property
    def prompt_tokens(self) -> int:
        return self.batch.prompt_tokens[self.i]

    @property
    def completion_tokens(self) -> int:
        return self.batch.completion_tokens[self.i]

    @property
    def cached_tokens(self) -> int:
        return self.batch.cached_tokens[self.i]

    @property
    def new_logprobs(self) -> list[float]:
        return self.batch.logprobs[self.i]

    @property
    def new_top_logprobs(self) -> list[list[tuple[int, float]]]:
        return self.batch.top_logprobs[self.i]

    @property
    def queue_time(self) -> float:
        return self.batch.queue_times[self.i]

    @property
    def num_retractions(self) -> int:
        return self.batch.num_retractions[self.i]

    @property
    def spec(self) -> tuple[int, int] | None:
        """(verify steps with drafts, drafts accepted) of a request that drafted, else None."""
        v = self.batch.spec.get(self.rid)
        return None if v is None else (int(v[0]), int(v[1]))

    @property
    def text(self) -> str:
        """The row's new text (the detokenizer's; "" before it ran)."""
        texts = self.batch.texts
        return texts[self.i] if self.i < len(texts) else ""

    @property
    def dp_rank(self) -> int:
        return self.batch.dp_rank

    def __repr__(self) -> str:
        return (f"OutRow({self.rid!r}, {self.new_token_ids}, {self.finished_reason!r}, text={self.text!r})")


def spec_meta(spec: tuple[int, int] | None) -> dict[str, float]:
    """``meta_info``'s speculative decoding fields (SGLang's ``spec_verify_ct``): verify steps that
    carried the request's drafts, drafts accepted, and the tokens a verify step gave on average;
    empty for a request that never drafted."""
    if spec is None:
        return {}
    ct, accepted = spec
    return {"spec_verify_ct": ct, "spec_accepted_tokens": accepted,
            "spec_accept_length": round((ct + accepted) / ct, 3) if ct else 0.0}
