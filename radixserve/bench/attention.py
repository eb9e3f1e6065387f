"""``radixserve bench attention``: one layer of decode attention, backend against backend.

For each batch size and context length, a KV pool of the model's shape is filled with random K/V
in shuffled pages (a pool after some churn: each request's pages are scattered; over a pool as
large as a server's with ``--pool-tokens``), every request
decodes one token, and each backend's ``forward`` for one layer (the new K/V written to the pool,
then attention over the whole context) is timed. Successive calls go to successive layers, as in a
model forward: timing one layer over and over would let its KV sit in the last-level cache (this
VM reports 480 MiB of L3), which a real step, reading every layer once, never sees. So the pool
has the model's layers, or as many as fit in ``--max-pool-mib``. The backends alternate for
``--rounds`` rounds (the machine drifts).

The figure a decode kernel is judged by is its effective bandwidth: the bytes it cannot avoid
reading (every request's K and V, plus its slot-table row) over its time, next to what this machine
can move: a STREAM-style copy of a large tensor measured in the same run (bytes read + written over
the time of ``dst.copy_(src)``, both cores), and the floor for this very access pattern: every K/V
row the kernel reads, read the same way (same pages, same split over threads, prefetched ahead)
with nothing computed but a sum (``read_kv_rows`` in the cpu_paged extension), timed in the same
alternated rounds. A kernel at that floor is bound by memory, not by its arithmetic.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from radixserve.bench.attention_args import add_args  # noqa: F401  (the CLI's, re-exported)
from radixserve.mem.forward_batch import ForwardBatch, SamplingBatchInfo
from radixserve.mem.kv_format import kv_format
from radixserve.mem.kv_pool import KVPool, ReqToTokenPool
from radixserve.model.attention_backend import AttentionBackend, create_attention_backend
from radixserve.results import write_result


def stream_copy_gbs(mib: int, iters: int = 5) -> float:
    """Best bandwidth of ``dst.copy_(src)`` over ``iters`` tries, counting bytes read + written."""
    n = mib * (1 << 20) // 4
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.zeros(n, dtype=torch.float32)
    best = float("inf")
    for _ in range(iters):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best / 1e9


class Layers:
    """``layers`` layers of KV pool, a slot table and a decode batch of ``batch`` requests at ``ctx``
    tokens; ``run`` attends the next layer each call."""

    def __init__(self, batch: int, ctx: int, heads: tuple[int, int, int], dtype: torch.dtype, page: int,
                 layers: int, seed: int = 0, pool_tokens: int = 0, kv_dtype: str = "auto") -> None:
        H, KVH, D = heads
        g = torch.Generator().manual_seed(seed)
        pages_per_req = -(-ctx // page)
        n_pages = batch * pages_per_req
        pool_pages = Layers.pool_pages(batch, ctx, page, pool_tokens)
        self.layers = layers
        self.next = 0
        self.kv = KVPool(pool_pages * page, page, layers, KVH, D, kv_format(kv_dtype, dtype))
        if self.kv.format.quantized:  # through the format: values and their scales
            rows = self.kv.k_buffers[0].shape[0]
            for i in range(layers):
                for s in range(0, rows, 1 << 16):
                    loc = torch.arange(s, min(rows, s + (1 << 16)))
                    self.kv.write(i, loc, torch.randn(len(loc), KVH, D, generator=g),
                                  torch.randn(len(loc), KVH, D, generator=g))
        else:
            for buf in self.kv.k_buffers + self.kv.v_buffers:
                buf.normal_(generator=g)
        self.r2t = ReqToTokenPool(batch, pages_per_req * page)
        # the batch's pages, anywhere in the pool (page 0 is the reserved padding page)
        pages = torch.randperm(pool_pages, generator=g)[:n_pages] + 1
        slots = (pages.view(-1, 1) * page + torch.arange(page)).view(batch, -1)
        self.r2t.req_to_token[:, : slots.shape[1]] = slots
        self.fb = ForwardBatch(
            input_ids=torch.zeros(batch, dtype=torch.int64),
            positions=torch.full((batch,), ctx - 1, dtype=torch.int64),
            out_cache_loc=self.r2t.req_to_token[:, ctx - 1].clone(),
            req_pool_indices=torch.arange(batch),
            seq_lens=torch.full((batch,), ctx, dtype=torch.int64),
            extend_prefix_lens=[ctx - 1] * batch,
            extend_seq_lens=[1] * batch,
            sampling=SamplingBatchInfo.greedy(batch),
        )
        self.q = torch.randn(batch, H, D, generator=g).to(dtype)
        self.k = torch.randn(batch, KVH, D, generator=g).to(dtype)
        self.v = torch.randn(batch, KVH, D, generator=g).to(dtype)
        # what any decode kernel must read per layer: K and V of every token (scales included), and the
        # token's slot id
        self.bytes = batch * ctx * (self.kv.bytes_per_token_here() // layers + 8)

    @staticmethod
    def pool_pages(batch: int, ctx: int, page: int, pool_tokens: int) -> int:
        return max(batch * -(-ctx // page), pool_tokens // page)

    @staticmethod
    def layer_bytes(batch: int, ctx: int, heads: tuple[int, int, int], dtype: torch.dtype, page: int,
                    pool_tokens: int = 0, kv_dtype: str = "auto") -> int:
        """Bytes of one layer's K and V buffers."""
        _, KVH, D = heads
        pages = Layers.pool_pages(batch, ctx, page, pool_tokens)
        return pages * page * KVPool.bytes_per_token(1, KVH, D, kv_format(kv_dtype, dtype))

    def run(self, backend: AttentionBackend) -> torch.Tensor:
        layer, self.next = self.next, (self.next + 1) % self.layers
        return backend.forward(self.q, self.k, self.v, layer, self.fb, self.kv, self.r2t)

    def read(self, ext: Any) -> float:
        """Read the next layer's K/V rows of every request and nothing else (the memory floor)."""
        layer, self.next = self.next, (self.next + 1) % self.layers
        return float(ext.read_kv_rows(self.kv.k_buffers[layer], self.kv.v_buffers[layer], self.r2t.req_to_token,
                                      self.fb.req_pool_indices, self.fb.seq_lens))


def time_ms(fn: Callable[[], object], iters: int) -> list[float]:
    """Milliseconds of each of ``iters`` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def main(ns: argparse.Namespace) -> int:
    if ns.num_threads:
        torch.set_num_threads(ns.num_threads)
    heads = (ns.num_heads, ns.num_kv_heads, ns.head_dim)
    num_layers = 30
    if None in heads:
        from radixserve.model.loader import load_config

        mc = load_config(ns.model_path)
        heads = (ns.num_heads or mc.num_heads, ns.num_kv_heads or mc.num_kv_heads, ns.head_dim or mc.head_dim)
        num_layers = mc.num_layers
    H, KVH, D = heads
    dtype = torch.bfloat16 if ns.dtype == "bfloat16" else torch.float32
    names = [n for n in ns.backends.split(",") if n]
    stat: Callable[[list[float]], float] = statistics.median if ns.stat == "median" else min
    kv_of = {n: n.partition("@")[2] or "auto" for n in names}  # each backend's pool format
    backends = {n: create_attention_backend(n.partition("@")[0], H, KVH, D) for n in names}
    from radixserve.model.paged_attention import extension, extension_error

    reader = extension() if extension_error() is None else None  # read_kv_rows: the memory floor
    stream = stream_copy_gbs(ns.stream_mb)
    pool = f"a pool of {ns.pool_tokens} slots per layer" if ns.pool_tokens else "a pool just large enough"
    print(f"decode attention, per layer: {H} heads, {KVH} KV heads, head_dim {D}, {ns.dtype}, page size "
          f"{ns.page_size}, {pool}, {torch.get_num_threads()} threads; {ns.stat} of {ns.rounds} alternated rounds "
          f"x {ns.iters} calls")
    print(f"STREAM-style copy: {stream:.1f} GB/s (read + write)")
    cols = "".join(f"{n + ' ms':>18}" for n in names)
    floor_cols = f"{'read-only ms':>14}{'of floor':>10}" if reader is not None else ""
    print(f"{'batch':>6}{'ctx':>6}{'layers':>7}{'MB read':>9}{cols}{'speed-up':>10}{'GB/s':>8}{'of copy':>9}{floor_cols}")
    rows: list[dict[str, Any]] = []
    with torch.inference_mode():
        for ctx in (int(c) for c in ns.contexts.split(",")):
            for batch in (int(b) for b in ns.batch_sizes.split(",")):
                kinds = list(dict.fromkeys(kv_of.values()))
                per_layer = sum(Layers.layer_bytes(batch, ctx, heads, dtype, ns.page_size, ns.pool_tokens, k)
                                for k in kinds)
                n_layers = max(1, min(num_layers, (ns.max_pool_mib << 20) // per_layer))
                pools = {k: Layers(batch, ctx, heads, dtype, ns.page_size, n_layers, pool_tokens=ns.pool_tokens,
                                   kv_dtype=k) for k in kinds}
                layer = pools[kv_of[names[-1]]]  # the pool of the backend the bandwidth columns are about
                got: dict[str, list[float]] = {n: [] for n in names}
                floor: list[float] = []
                for _ in range(ns.rounds):
                    for n, be in backends.items():
                        be.init_forward_metadata(pools[kv_of[n]].fb, pools[kv_of[n]].r2t)
                        got[n] += time_ms(functools.partial(pools[kv_of[n]].run, be), ns.iters)
                    if reader is not None:
                        floor += time_ms(functools.partial(layer.read, reader), ns.iters)
                med = {n: stat(v) for n, v in got.items()}
                last = names[-1]
                gbs = layer.bytes / (med[last] * 1e-3) / 1e9
                speed = med[names[0]] / med[last]
                times = "".join(f"{med[n]:>18.3f}" for n in names)
                floor_ms = stat(floor) if floor else None
                floor_txt = f"{floor_ms:>14.3f}{floor_ms / med[last]:>9.0%}" if floor_ms is not None else ""
                print(f"{batch:>6}{ctx:>6}{n_layers:>7}{layer.bytes / 1e6:>9.1f}{times}{speed:>9.2f}x{gbs:>8.1f}"
                      f"{gbs / stream:>8.0%}{floor_txt}")
                rows.append({"batch": batch, "ctx": ctx, "layers": n_layers, "bytes": layer.bytes, "ms": med,
                             "speedup": speed, "effective_gbs": gbs, "read_only_ms": floor_ms,
                             "read_only_gbs": layer.bytes / (floor_ms * 1e-3) / 1e9 if floor_ms else None})
                del layer, pools
    print(f"speed-up: {names[0]} / {names[-1]}; MB read: K, V and slot ids of one layer; GB/s and 'of copy': "
          f"{names[-1]}'s bytes read over its time, against the copy's bandwidth; layers: how many the calls cycle "
          "through" + ("; read-only: the same rows read with nothing computed (the memory floor), 'of floor': its "
                       f"time over {names[-1]}'s" if reader is not None else ""))
    if ns.output:
        write_result(ns.output, {"stream_copy_gbs": stream, "dtype": ns.dtype, "stat": ns.stat, "heads": heads,
                                 "rows": rows})
    return 0

