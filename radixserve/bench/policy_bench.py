"""Micro-benchmark: what ``--schedule-policy lpm`` costs per step with a long queue and a large tree.

Builds a radix tree of ``num_seqs`` cached sequences of ``seq_len`` tokens (``num_groups`` shared
system prompts of ``shared_len`` tokens, each followed by its own tail), then times the lpm ordering
of ``num_waiting`` waiting requests with the fcfs fallback disabled (``--lpm-fallback-threshold 0``):

- ``cold``: the first ordering (every request is matched once);
- ``warm``: later steps with an unchanged tree (a decode step);
- ``churn``: steps after which the tree changed: one prefill's prompt inserted and some leaves
  evicted (a typical prefill step);
- ``resort``: a round that falls back to the full sort (the kept order is dropped, as after an
  abort from the middle of the queue, aging's re-sort or a policy switch); the matches are kept;
- ``naive``: for reference, re-matching every request from the root with ``match_prefix``, as
  SGLang does each step (the reason it falls back to fcfs past 128 requests).

    python -m radixserve.bench.policy_bench [--num-seqs 2000 --seq-len 500 --num-waiting 10000]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from radixserve.mem.allocator import TokenToKVPoolAllocator
from radixserve.mem.base_cache import RadixKey
from radixserve.mem.kv_pool import ReqToTokenPool
from radixserve.mem.radix_cache import RadixCache
from radixserve.sched.policies import PolicyContext, get_policy
from radixserve.sched.req import Req
from radixserve.sched.sampling_params import SamplingParams


def _insert(tree: RadixCache, ids: list[int]) -> None:
    alloc = tree.allocator
    if alloc.available_size() < len(ids):
        tree.evict(len(ids) - alloc.available_size())
    vals = alloc.alloc(len(ids))
    dup = tree.insert(RadixKey(ids), vals)
    alloc.free(vals[:dup])


def build_tree(
    num_seqs: int = 2000, seq_len: int = 500, num_groups: int = 50, shared_len: int = 200, seed: int = 0
) -> tuple[RadixCache, list[list[int]]]:
    """A ``RadixCache`` holding ``num_seqs`` sequences (and room for a little more)."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 32000) for _ in range(shared_len)] for _ in range(num_groups)]
    seqs = [rng.choice(systems) + [rng.randrange(1, 32000) for _ in range(seq_len - shared_len)]
            for _ in range(num_seqs)]
    alloc = TokenToKVPoolAllocator(num_seqs * seq_len + 64 * seq_len)
    tree = RadixCache(ReqToTokenPool(1, 1), alloc)
    for s in seqs:
        _insert(tree, s)
    return tree, seqs


def make_waiting(seqs: list[list[int]], num_waiting: int = 10000, seed: int = 1) -> list[Req]:
    """Requests that share a random-length prefix of a cached sequence, then go their own way."""
    rng = random.Random(seed)
    reqs = []
    for i in range(num_waiting):
        base = rng.choice(seqs)
        keep = rng.randrange(0, len(base))
        ids = base[:keep] + [rng.randrange(1, 32000) for _ in range(rng.randrange(1, 64))]
        reqs.append(Req(f"w{i}", ids, SamplingParams(max_new_tokens=16), arrival_time=float(i)))
    return reqs


def bench_lpm_order(
    num_seqs: int = 2000, seq_len: int = 500, num_waiting: int = 10000, repeats: int = 5, naive: bool = True,
    seed: int = 0,
) -> dict[str, float]:
    """Milliseconds per lpm ordering (see the module docstring); ``churn_rematched_min``/``_max``: how
    many requests a churn round matched again."""
    tree, seqs = build_tree(num_seqs, seq_len, seed=seed)
    waiting = make_waiting(seqs, num_waiting, seed + 1)
    policy = get_policy("lpm")
    ctx = PolicyContext(prefix_tree=tree, now=0.0, lpm_fallback_threshold=0)
    rng = random.Random(seed + 2)

    cpu: dict[str, list[float]] = {}

    def timed(name: str) -> float:  # one scheduler step's ordering; the queue keeps the order, as the scheduler's does
        t0, c0 = time.perf_counter(), time.process_time()
        order = policy.order(waiting, ctx)
        ms = (time.perf_counter() - t0) * 1e3
        cpu.setdefault(name, []).append((time.process_time() - c0) * 1e3)
        assert len(order) == len(waiting)
        waiting[:] = order
        return ms

    out = {"cold_ms": timed("cold")}
    out["warm_ms"] = statistics.median(timed("warm") for _ in range(repeats))
    churn, rematched = [], []
    matches = policy.matches  # type: ignore[attr-defined]
    for _ in range(repeats):
        _insert(tree, rng.choice(seqs)[: rng.randrange(50, seq_len)] + [rng.randrange(1, 32000) for _ in range(300)])
        tree.evict(seq_len)
        n0 = matches.num_matched
        churn.append(timed("churn"))
        rematched.append(matches.num_matched - n0)
    out["churn_ms"] = statistics.median(churn)
    out["churn_rematched_min"], out["churn_rematched_max"] = min(rematched), max(rematched)
    resort = []
    for _ in range(repeats):
        policy.incremental.reset()  # type: ignore[attr-defined]
        resort.append(timed("resort"))
    out["resort_ms"] = statistics.median(resort)
    for name, v in cpu.items():  # CPU time: steadier than wall time on a shared machine
        out[f"{name}_cpu_ms"] = statistics.median(v)
    if naive:
        t0 = time.perf_counter()
        lens = [len(tree.match_prefix(RadixKey(r.fill_ids[:-1])).device_indices) for r in waiting]
        sorted(range(len(waiting)), key=lambda i: (-lens[i], waiting[i].arrival_time))
        out["naive_ms"] = (time.perf_counter() - t0) * 1e3
        # the incremental lengths are the real ones, and the order follows them
        assert policy.matches.prefix_lens(waiting, tree) == lens  # type: ignore[attr-defined]
        got = policy.order(waiting, PolicyContext(prefix_tree=tree, now=0.0, lpm_fallback_threshold=0,
                                                  in_batch_deprioritize_threshold=0))
        fresh = {id(r): n for r, n in zip(waiting, lens, strict=True)}
        assert all(fresh[id(a)] >= fresh[id(b)] for a, b in zip(got, got[1:], strict=False))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-seqs", type=int, default=2000)
    ap.add_argument("--seq-len", type=int, default=500)
    ap.add_argument("--num-waiting", type=int, default=10000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-naive", action="store_true", help="skip the from-scratch re-match reference")
    a = ap.parse_args(argv)
    r = bench_lpm_order(a.num_seqs, a.seq_len, a.num_waiting, a.repeats, naive=not a.no_naive)
    print(f"lpm ordering of {a.num_waiting} waiting requests, tree of {a.num_seqs} x {a.seq_len} tokens, "
          f"fallback disabled:")
    for k, v in r.items():
        if k.endswith("_ms"):
            print(f"  {k[:-3]:>10}: {v:8.2f} ms")
        else:  # requests matched again in a churn round (their watcher fired)
            print(f"  {k}: {v}")


if __name__ == "__main__":
    main()
