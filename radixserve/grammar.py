"""Structured output: grammars that constrain which tokens a request may sample, through llguidance.

A request names at most one grammar (``SamplingParams``): a JSON schema (``json_schema``; OpenAI's
``response_format`` maps onto it), a regular expression (``regex``) or a context-free grammar in
GBNF / Lark (``ebnf``). Its life::

    HTTP edge          validate_grammar(kind, text)     -> 400 naming the field when it is invalid
    scheduler intake   GrammarCompiler.submit(...)      -> a Future; the request waits in the
                                                           scheduler's grammar queue meanwhile
    compile thread     LLMatcher(tokenizer, grammar)    (about 1 ms for a JSON schema here; the
                                                           GIL is released while it builds)
    every step         sampler: fill_masks -> mask the row's logits -> draw -> advance
                       (on the thread that runs the forward, so the overlap loop's next step sees
                       the matcher after this step's token)

Why llguidance (measured on the bundled SmolLM2 tokenizer, docs/benchmarks.md, "Grammar engines"):
no dependencies (xgrammar needs torch, transformers and triton), compiling a JSON schema takes
about 1 ms (xgrammar 6-23 ms), and one token mask 30-110 us: nothing against a decode step.

A matcher that stops (its grammar is complete: only EOS may follow) ends the request with a
``stop`` finish reason; a matcher in an error state (a token it refused: cannot happen while its
mask is applied, but it is checked) aborts the request with the matcher's message.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

GRAMMAR_KINDS = ("json_schema", "regex", "ebnf")
_CACHE_SIZE = 256  # compiled grammars kept (a prototype matcher each; requests get deep copies)


class GrammarError(ValueError):
    pass


def grammar_text(kind: str, text: str) -> str:
    """The llguidance grammar for one of ``GRAMMAR_KINDS`` (``GrammarError`` on a malformed one)."""
    import llguidance

    if kind == "json_schema":
        try:
            schema = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise GrammarError(f"not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("a JSON schema must be an object")
        try:
            return str(llguidance.LLMatcher.grammar_from_json_schema(text))
        except Exception as e:  # llguidance raises ValueError or RuntimeError for a bad schema
            raise GrammarError(str(e)) from None
    if kind == "regex":
        return str(llguidance.LLMatcher.grammar_from_regex(text))
    if kind == "ebnf":
        try:
            return str(llguidance.grammar_from("gbnf", text))  # GBNF, or Lark (llguidance tells them apart)
        except Exception as e:
            raise GrammarError(str(e)) from None
    raise GrammarError(f"unknown grammar kind {kind!r}; one of {', '.join(GRAMMAR_KINDS)}")


def validate_grammar(kind: str, text: str) -> str | None:
    """What is wrong with the grammar, or None: what the HTTP edge checks before it queues a request
    (no tokenizer needed; about a millisecond for a JSON schema)."""
    import llguidance

    try:
        g = grammar_text(kind, text)
    except GrammarError as e:
        return str(e)
    try:
        err = llguidance.LLMatcher.validate_grammar(g)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # a panic in the Rust code is a BaseException: still the grammar's fault
        return f"the grammar engine failed on it: {e}"
    return err.strip() if err else None


class GrammarCompiler:
    """Builds a matcher per request for one tokenizer, on a background thread, and keeps the last
    ``cache_size`` compiled grammars (a request for a grammar seen before gets a copy at once).

    ``tokenizer_json``: a callable returning the HF ``tokenizer.json`` text of the model's tokenizer,
    called once on the compile thread. Building llguidance's tokenizer from it takes 0.5-2 s here and
    holds the GIL all along, so ``warm_up`` starts it when the engine starts, not under the first
    request with a grammar (it would stall the scheduler loop for as long)."""

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int, eos_token_ids: Sequence[int],
                 cache_size: int = _CACHE_SIZE) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.cache_size = cache_size
        self._tokenizer: Any = None
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def warm_up(self) -> Future:
        """Build llguidance's tokenizer now, on the compile thread."""
        return self._executor().submit(self._lltokenizer)

    def cached(self, kind: str, text: str) -> Any | None:
        """A fresh matcher for a grammar compiled before, or None."""
        with self._lock:
            proto = self._cache.get((kind, text))
            if proto is None:
                return None
            self._cache.move_to_end((kind, text))
        return proto.deep_copy()

    def submit(self, kind: str, text: str) -> Future:
        """A future of a fresh matcher (``GrammarError`` when the grammar does not compile)."""
        return self._executor().submit(self._compile, kind, text)

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        return self._pool

    def _lltokenizer(self) -> Any:
        import llguidance

        if self._tokenizer is None:
            self._tokenizer = llguidance.LLTokenizer(self._tokenizer_json(), n_vocab=self.vocab_size,
                                                     eos_token=self.eos_token_ids)
        return self._tokenizer

    def _compile(self, kind: str, text: str) -> Any:
        import llguidance

        hit = self.cached(kind, text)
        if hit is not None:
            return hit
        proto = llguidance.LLMatcher(self._lltokenizer(), grammar_text(kind, text), log_level=0)
        if proto.is_error():
            raise GrammarError(proto.get_error())
        with self._lock:
            self._cache[(kind, text)] = proto
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return proto.deep_copy()

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


# --- the sampler's side: masks and advancing, one step at a time -----------------------------------
def live_rows(matchers: Sequence[Any | None]) -> list[int]:
    """The rows whose matcher still constrains the next token (not stopped: a stopped matcher's
    request has ended, and the overlap loop's extra step for it samples a token that is dropped)."""
    return [i for i, m in enumerate(matchers) if m is not None and not m.is_stopped()]


def mask_logits(scores: torch.Tensor, matchers: Sequence[Any | None], rows: list[int]
                ) -> tuple[torch.Tensor, dict[int, str]]:
    """``scores`` [B, V] with the tokens each of ``rows``' grammars refuses set to -inf: a new tensor
    (the caller's stays as it was: logprobs are reported from the model's own logits). Also the rows
    whose grammar engine failed (left unmasked: their requests end with the error, the batch goes on)."""
    import llguidance.torch as llt
    import torch  # here: the HTTP process validates grammars and never imports torch

    B, V = scores.shape
    words = (V + 31) // 32
    bitmask = torch.empty(len(rows), words, dtype=torch.int32)
    failed: dict[int, str] = {}
    for j, i in enumerate(rows):  # about 30-110 us each
        try:
            llt.fill_next_token_bitmask(matchers[i], bitmask, j)  # type: ignore[arg-type]
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # a Rust panic is a BaseException; it ends this request only
            bitmask[j] = -1
            failed[i] = f"the grammar engine failed: {e!r}"
    import numpy as np  # here, not at the top: the detokenizer imports this module but never masks

    # numpy unpacks the bits in one C pass (0.3 ms for 32 rows here; torch's shift-and-mask took
    # 20x that), and a select (branch-free) applies them: about 1.5 ms for 32 rows of 49k tokens
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :V]
    allowed = torch.from_numpy(bits).view(torch.bool)
    if len(rows) == B:  # every row has a grammar: no gather and scatter
        return torch.where(allowed, scores, float("-inf")), failed
    idx = torch.tensor(rows, dtype=torch.int64)
    sub = torch.where(allowed, scores.index_select(0, idx), float("-inf"))
    return scores.index_copy(0, idx, sub), failed


def advance(matchers: Sequence[Any | None], rows: list[int], tokens: Sequence[int],
            failed: dict[int, str] | None = None) -> dict[int, str]:
    """Feed each of ``rows`` its sampled token (not the ``failed`` ones of ``mask_logits``). Returns
    the rows whose grammar ended with it: ``""`` when complete (only EOS may follow), else the error."""
    ended: dict[int, str] = dict(failed or {})
    for i in rows:
        if i in ended:
            continue
        m: Any = matchers[i]
        try:
            m.consume_token(int(tokens[i]))
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:
            ended[i] = f"the grammar engine failed: {e!r}"
            continue
        if m.is_error():
            ended[i] = m.get_error() or "the grammar refused the token"
        elif m.is_stopped():
            ended[i] = ""
    return ended


def masks_along(matcher: Any, drafts: Sequence[int], vocab: int) -> torch.Tensor:
    """Speculative decoding: the tokens ``matcher``'s grammar allows at each position of a verify
    row, ``[n, vocab]`` bool, where position ``j`` follows ``drafts[:j]``. Stops at the first draft
    the grammar refuses or that completes it (no later position can be kept), so ``n <= len(drafts)
    + 1``. The matcher is left as it was (the drafts it consumed are rolled back)."""
    import llguidance.torch as llt
    import torch

    words = (vocab + 31) // 32
    bitmask = torch.empty(len(drafts) + 1, words, dtype=torch.int32)
    n = consumed = 0
    try:
        for j in range(len(drafts) + 1):
            llt.fill_next_token_bitmask(matcher, bitmask, j)
            n = j + 1
            if j == len(drafts):
                break
            d = int(drafts[j])
            if d < 0 or d >= vocab or not (int(bitmask[j, d // 32]) >> (d % 32)) & 1:
                break
            matcher.consume_token(d)
            consumed += 1
            if matcher.is_error() or matcher.is_stopped():
                break
    finally:
        if consumed:
            matcher.rollback(consumed)
    import numpy as np

    bits = np.unpackbits(bitmask[:n].numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    return torch.from_numpy(bits).view(torch.bool)
