"""Test doubles shared by scheduler tests: a runner with a deterministic next-token rule."""

from __future__ import annotations

from collections.abc import Callable

from radixserve.config import ServerArgs
from radixserve.mem.draft_tree import walk
from radixserve.mem.forward_batch import ForwardBatch, ForwardOutput, PromptLogprobs, VerifyRows
from radixserve.mem.kv_pool import ReqToTokenPool
from radixserve.sched.build import build_kv, build_scheduler
from radixserve.sched.core import SchedulerCore
from radixserve.sched.kv_manager import KVManager

VOCAB = 1000


class EchoRunner:
    """Next token = (last input token + position + 1) % VOCAB, never 0 (EOS is 0 in these tests).

    It also checks what the scheduler promised: slots written are distinct and not the padding
    page, and each request's req_to_token row holds exactly the slots of its past + new tokens.
    """

    def __init__(self, req_to_token_pool: ReqToTokenPool | None = None) -> None:
        self.batches: list[ForwardBatch] = []
        self.pool = req_to_token_pool

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        self.batches.append(batch)
        loc = batch.out_cache_loc.tolist()
        assert len(set(loc)) == len(loc), "a KV slot was handed out twice in one batch"
        assert batch.num_tokens == sum(batch.extend_seq_lens)
        out = []
        off = 0
        for i, n in enumerate(batch.extend_seq_lens):
            off += n
            last_tok = int(batch.input_ids[off - 1])
            pos = int(batch.positions[off - 1])
            if self.pool is not None:
                row = self.pool.req_to_token[int(batch.req_pool_indices[i])]
                p = batch.extend_prefix_lens[i]  # (a draft tree's positions are depths, its slots in draft order)
                assert row[p : p + n].tolist() == loc[off - n : off]
            out.append(self.next_token(last_tok, pos))
        result = ForwardOutput(next_token_ids=out)
        if batch.verify is not None:  # the same rule at every drafted position of a verify row
            ids, positions = batch.input_ids.tolist(), batch.positions.tolist()
            if batch.verify.parents is None:
                result.verified = [[self.next_token(ids[f], positions[f]) for f in batch.verify.positions[a:b]]
                                   + [out[row]] for row, a, b in _verify_slices(batch.verify)]
            else:
                result.verified, result.verify_paths = self._walk_trees(batch, ids, positions)
        rows = batch.prompt_logprobs
        if rows is not None:  # a made-up logprob of each target from the input token and position it follows
            ids, positions = batch.input_ids.tolist(), batch.positions.tolist()
            lps = [fake_logprob(ids[f], target, positions[f]) for f, target in zip(rows.positions, rows.targets, strict=True)]
            tops = [[(target, lp)] * n for target, lp, n in zip(rows.targets, lps, rows.top_n, strict=True)]
            result.prompt_logprobs = PromptLogprobs(rows, lps, tops)
        return result

    def next_token(self, token: int, position: int) -> int:
        return (token + position + 1) % (VOCAB - 1) + 1

    def _walk_trees(self, batch: ForwardBatch, ids: list[int], positions: list[int]) -> tuple[list[list[int]], list[list[int]]]:
        """Each verify row's walk down its draft tree by the rule (mem/draft_tree.py): the tokens
        along the kept path (-1 after) and the drafts on it."""
        assert batch.verify is not None and batch.verify.parents is not None
        starts = [sum(batch.extend_seq_lens[:i]) for i in range(batch.batch_size)]
        verified, paths = [], []
        for row, parents in zip(batch.verify.rows, batch.verify.parents, strict=True):
            f0 = starts[row]  # the last token's flat index; draft c's is f0 + 1 + c
            draft = ids[f0 + 1 : f0 + 1 + len(parents)]
            toks, path = walk(parents, draft, lambda j, _, f0=f0: self.next_token(ids[f0 + j], positions[f0 + j]))
            verified.append(toks + [-1] * (len(parents) + 1 - len(toks)))
            paths.append(path)
        return verified, paths


def _verify_slices(verify: VerifyRows) -> list[tuple[int, int, int]]:
    """(row, start, end) of each verify row's entries in ``verify.positions``."""
    out, a = [], 0
    for row, d in zip(verify.rows, verify.drafts, strict=True):
        out.append((row, a, a + len(d)))
        a += len(d)
    return out


def fake_logprob(prev: int, token: int, position: int) -> float:
    """``EchoRunner``'s logprob of ``token`` after ``prev`` at ``position``."""
    return -((prev * 31 + token * 7 + position) % 1000) / 100


def expected_prompt_logprobs(prompt: list[int], start: int) -> list[float | None]:
    """What ``EchoRunner`` gives as the logprobs of ``prompt``'s tokens from ``start`` on."""
    return [None if j == 0 else fake_logprob(prompt[j - 1], prompt[j], j - 1) for j in range(start, len(prompt))]


def make_scheduler(
    pool_tokens: int = 256,
    max_reqs: int = 16,
    context_len: int = 512,
    page_size: int = 1,
    radix: bool = True,
    runner: Callable[[ReqToTokenPool], EchoRunner] = EchoRunner,
    window: int | None = None,
    local_window: int | None = None,
    **kw: object,
) -> tuple[SchedulerCore, EchoRunner, KVManager]:
    """A scheduler over ``runner(request-slot pool)`` (an ``EchoRunner`` or a subclass); ``window``:
    the model's whole-model sliding window (``KVManager`` frees KV behind it); ``local_window``: the
    window of sliding layers among global ones (their own slots: mem/window_kv.py)."""
    args = ServerArgs.from_kwargs(page_size=page_size, disable_radix_cache=not radix, **kw)  # type: ignore[arg-type]
    # built as the engine and the simulator build theirs (sched/build.py), over a pool of max_reqs slots
    kv = build_kv(args, pool_tokens, context_len, max_reqs=max_reqs, window=window, local_window=local_window)
    model = runner(kv.req_to_token_pool)
    sched = build_scheduler(args, model, kv, context_len=context_len, vocab_size=VOCAB, eos_token_ids=[0])
    return sched, model, kv


def drain(sched: SchedulerCore, max_steps: int = 10000) -> list:
    outs = []
    for _ in range(max_steps):
        outs.extend(sched.step())
        if not sched.has_work():
            outs.extend(sched.step())  # the idle step runs the self-check
            sched.kv.check_invariant()
            return outs
    raise AssertionError("scheduler did not drain")


def expected_tokens(prompt: list[int], n: int) -> list[int]:
    """What EchoRunner generates for ``prompt`` without any batching effects."""
    toks = list(prompt)
    out = []
    for _ in range(n):
        t = (toks[-1] + len(toks) - 1 + 1) % (VOCAB - 1) + 1
        out.append(t)
        toks.append(t)
    return out
