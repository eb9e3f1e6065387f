"""``radixserve bench radix``: the prefix cache's own cost, without a model.

A chat-like trace builds a ``RadixCache`` over a pool of ``--tokens`` KV slots: requests share one
of ``--prefixes`` system prompts and continue it with a conversation (a few turns, each one
extending the last) and a private tail, until the tree holds the pool. Each request is inserted as
a finished request is (its slots allocated, the part the tree already had freed again), then every
request is matched once, then half of the tree is evicted. Each phase is timed twice in the same
process, alternated ``--rounds`` times: with the real slot allocator, and with a stand-in that only
counts what it is given, so the allocator's share of each phase is the difference (the tree's walk
is the same in both).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from radixserve.bench.radix_args import add_args  # noqa: F401  (the CLI's, re-exported)
from radixserve.mem.allocator import TokenToKVPoolAllocator
from radixserve.mem.base_cache import RadixKey
from radixserve.mem.kv_pool import ReqToTokenPool
from radixserve.mem.radix_cache import RadixCache
from radixserve.results import write_result


class CountingAllocator(TokenToKVPoolAllocator):
    """Hands out slots like the real allocator but takes none back: ``free`` only counts, so a
    phase timed with it is the tree's walk alone."""

    def __init__(self, size: int, page_size: int) -> None:
        super().__init__(size, page_size)
        self.freed = 0

    def free(self, slots: Any) -> None:
        self.freed += len(slots)


def make_trace(tokens: int, prefixes: int, page_size: int, seed: int) -> list[list[int]]:
    """Requests whose new (uncached) tokens add up to about ``tokens``: a shared system prompt
    (300-2,000 tokens), then turns of one conversation (each request is the last one plus a turn),
    then a private tail; token ids are random over a 49k vocabulary."""
    rng = random.Random(seed)
    vocab = 49152

    def run(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    systems = [run(rng.randrange(300, 2000)) for _ in range(prefixes)]
    budget = tokens - sum(len(s) + page_size for s in systems)
    out: list[list[int]] = []
    while budget > 0:
        convo = list(rng.choice(systems))
        for _ in range(rng.randrange(1, 6)):
            shared = len(convo)  # what the tree has of this request already (the last turn's prefix)
            convo += run(rng.randrange(50, 400))
            req = convo + run(rng.randrange(20, 200))
            req = req[: len(req) - len(req) % page_size]
            budget -= len(req) - shared + page_size  # its new tokens (and a partial page, at most)
            if budget <= 0:
                return out
            out.append(req)
    return out


def _one_round(trace: list[list[int]], tokens: int, page_size: int, counting: bool) -> dict[str, float]:
    alloc = CountingAllocator(tokens, page_size) if counting else TokenToKVPoolAllocator(tokens, page_size)
    tree = RadixCache(ReqToTokenPool(1, 1), alloc)
    keys = [RadixKey(r) for r in trace]
    t0 = time.perf_counter()
    for key in keys:
        have = tree.match_prefix(key).device_indices
        need = len(key.token_ids) - len(have)
        slots = list(have) + alloc.alloc(need)  # as a request's KV list starts out
        dup_end = tree.insert(key, slots)
        alloc.free(slots[len(have):dup_end])
    t1 = time.perf_counter()
    for key in keys:
        tree.match_prefix(key)
    t2 = time.perf_counter()
    cached = tree.evictable_size()
    evicted = tree.evict(cached // 2)
    t3 = time.perf_counter()
    tree.check_integrity()
    if not counting and alloc.available_size() + tree.evictable_size() + tree.protected_size() != tokens:
        raise AssertionError("KV slots leaked")
    return {"insert_ms": (t1 - t0) * 1e3, "match_ms": (t2 - t1) * 1e3, "evict_half_ms": (t3 - t2) * 1e3,
            "cached_tokens": cached, "evicted_tokens": evicted}


def main(ns: argparse.Namespace) -> int:
    trace = make_trace(ns.tokens, ns.prefixes, ns.page_size, ns.seed)
    print(f"trace: {len(trace)} requests, {sum(map(len, trace))} prompt tokens, pool {ns.tokens} slots, "
          f"page size {ns.page_size}")
    got: dict[str, list[dict[str, float]]] = {"allocator": [], "counting": []}
    for r in range(ns.rounds):
        for name in ("allocator", "counting"):
            got[name].append(_one_round(trace, ns.tokens, ns.page_size, counting=name == "counting"))
        print(f"  round {r + 1}/{ns.rounds} done", flush=True)
    figures: dict[str, Any] = {}
    for name, runs in got.items():
        best = {k: min(run[k] for run in runs) for k in ("insert_ms", "match_ms", "evict_half_ms")}
        best["evict_half_median_ms"] = statistics.median(run["evict_half_ms"] for run in runs)
        best["cached_tokens"] = runs[0]["cached_tokens"]
        best["evicted_tokens"] = runs[0]["evicted_tokens"]
        figures[name] = best
    a, c = figures["allocator"], figures["counting"]
    print(f"{'phase':<14}{'allocator ms':>14}{'tree only ms':>14}{'allocator share':>17}")
    for k in ("insert_ms", "match_ms", "evict_half_ms"):
        share = (a[k] - c[k]) / a[k] if a[k] else 0.0
        print(f"{k[:-3]:<14}{a[k]:>14.1f}{c[k]:>14.1f}{share:>16.0%}")
    print(f"evicted {a['evicted_tokens']} of {a['cached_tokens']} cached tokens")
    if ns.output:
        write_result(ns.output, {"benchmark": "radix", "tokens": ns.tokens, "page_size": ns.page_size,
                                 "requests": len(trace), "rounds": ns.rounds, **figures})
    return 0
