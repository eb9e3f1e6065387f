#!/usr/bin/env python
"""Compare grammar engines on the model's own tokenizer: llguidance (what radixserve uses) and,
when it is importable, xgrammar.

    python scripts/bench_grammar_engines.py [--model PATH] [--steps 40] [--repeats 5]

For a JSON schema, ``{"type": "object"}`` (OpenAI's json_object), a regex and a GBNF grammar it
prints: the one-off cost of wrapping the tokenizer, the compile time of each grammar (median and
max over ``--repeats`` fresh compiles, caches off), and per generated token the median and max time
to fill one row's token mask and to advance the matcher, over ``--steps`` tokens drawn from random
logits under the mask. xgrammar is not a dependency (it needs torch, transformers and triton);
install it beside radixserve to compare (``pip install --no-deps xgrammar apache-tvm-ffi``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from radixserve.model.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
    "tags": {"type": "array", "items": {"type": "string"}}, "city": {"enum": ["Paris", "London", "Tokyo"]}},
    "required": ["name", "age", "city"]}
REGEX = r"(\+|-)?[0-9]{3}-[0-9]{4}"
GBNF = 'root ::= "yes" | "no" | answer\nanswer ::= [a-z]+'
SHIFTS = torch.arange(32, dtype=torch.int32)


def _walk(fill: Callable[[torch.Tensor], None], accept: Callable[[int], None], done: Callable[[], bool],
          vocab: int, steps: int) -> tuple[list[float], list[float]]:
    words = (vocab + 31) // 32
    bitmask = torch.full((1, words), -1, dtype=torch.int32)
    gen = torch.Generator().manual_seed(0)
    fills, accepts = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        fill(bitmask)
        fills.append(time.perf_counter() - t0)
        allowed = ((bitmask[0].unsqueeze(-1) >> SHIFTS) & 1).view(-1)[:vocab].bool()
        logits = torch.randn(vocab, generator=gen).masked_fill_(~allowed, float("-inf"))
        token = int(logits.argmax())
        t0 = time.perf_counter()
        accept(token)
        accepts.append(time.perf_counter() - t0)
        if done():
            break
    return fills, accepts


def _report(engine: str, kind: str, compiles: list[float], fills: list[float], accepts: list[float]) -> None:
    us = 1e6
    print(f"{engine:<11} {kind:<12} compile {statistics.median(compiles) * 1e3:7.2f} ms (max {max(compiles) * 1e3:6.2f})"
          f"   mask {statistics.median(fills) * us:6.0f} us (max {max(fills) * us:7.0f})"
          f"   advance {statistics.median(accepts) * us:5.0f} us   tokens {len(fills)}")


def bench_llguidance(tok: Tokenizer, vocab: int, steps: int, repeats: int) -> None:
    import llguidance
    import llguidance.torch as llt

    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=vocab, eos_token=tok.stop_token_ids)
    print(f"llguidance  tokenizer    {time.perf_counter() - t0:.2f} s (once per process)")
    grammars = {
        "json_schema": llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA)),
        "json_object": llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}'),
        "regex": llguidance.LLMatcher.grammar_from_regex(REGEX),
        "gbnf": llguidance.grammar_from("gbnf", GBNF),
    }
    for kind, g in grammars.items():
        compiles: list[float] = []
        m: Any = None
        for _ in range(repeats):
            t0 = time.perf_counter()
            m = llguidance.LLMatcher(lltok, g, log_level=0)
            compiles.append(time.perf_counter() - t0)
        fills, accepts = _walk(lambda bm, m=m: llt.fill_next_token_bitmask(m, bm, 0), m.consume_token,
                               m.is_stopped, vocab, steps)
        _report("llguidance", kind, compiles, fills, accepts)


def bench_xgrammar(tok: Tokenizer, vocab: int, steps: int, repeats: int) -> None:
    try:
        import xgrammar as xgr
    except ImportError:
        print("xgrammar    not installed: skipped")
        return
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo([tok.token_bytes(i) for i in range(vocab)], vocab_type=xgr.VocabType.RAW,
                             vocab_size=vocab, stop_token_ids=tok.stop_token_ids)
    comp = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    print(f"xgrammar    tokenizer    {time.perf_counter() - t0:.2f} s (once per process)")
    makers = {
        "json_schema": lambda: comp.compile_json_schema(json.dumps(SCHEMA)),
        "json_object": lambda: comp.compile_json_schema('{"type": "object"}'),
        "regex": lambda: comp.compile_regex(REGEX),
        "gbnf": lambda: comp.compile_grammar(GBNF),
    }
    for kind, make in makers.items():
        compiles: list[float] = []
        cg: Any = None
        for _ in range(repeats):
            t0 = time.perf_counter()
            cg = make()
            compiles.append(time.perf_counter() - t0)
        m = xgr.GrammarMatcher(cg)
        fills, accepts = _walk(lambda bm, m=m: m.fill_next_token_bitmask(bm, 0), m.accept_token, m.is_terminated,
                               vocab, steps)
        _report("xgrammar", kind, compiles, fills, accepts)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF file or checkpoint directory (default: the bundled SmolLM2)")
    ap.add_argument("--steps", type=int, default=40, help="tokens generated under each grammar (default 40)")
    ap.add_argument("--repeats", type=int, default=5, help="fresh compiles of each grammar (default 5)")
    a = ap.parse_args(argv)
    tok = Tokenizer.from_model_path(a.model)
    vocab = tok.vocab_size
    print(f"tokenizer: {vocab} tokens")
    bench_llguidance(tok, vocab, a.steps, a.repeats)
    bench_xgrammar(tok, vocab, a.steps, a.repeats)


if __name__ == "__main__":
    main()
