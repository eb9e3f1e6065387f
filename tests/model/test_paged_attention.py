"""The cpu_paged decode kernel equals TorchNativeAttention: ragged batches, page sizes 1 and 16,
shared prefixes, bf16 and float32 pools, GQA ratios 1 and 3, batch 1 over a long context (split
over threads), mixed prefill + decode batches; and the whole engine's greedy tokens match."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import radixserve.model.paged_attention as paged
from radixserve.mem.forward_batch import ForwardBatch, SamplingBatchInfo
from radixserve.mem.kv_pool import KVPool, ReqToTokenPool
from radixserve.model.attention import TorchNativeAttention
from radixserve.model.attention_backend import create_attention_backend

_ERR = paged.extension_error()
needs_ext = pytest.mark.skipif(_ERR is not None, reason=f"cpu_paged extension could not be built: {_ERR}")


class Pool:
    """A one-layer KV pool filled with random K/V, and a slot table whose requests hold scattered
    pages; ``fork`` makes a request that shares another's first tokens (a radix-cache hit)."""

    def __init__(self, page: int, kvh: int, d: int, dtype: torch.dtype, pages: int, seed: int) -> None:
        self.g = torch.Generator().manual_seed(seed)
        self.page = page
        self.kv = KVPool(pages * page, page, 1, kvh, d, dtype)
        self.kv.k_buffers[0].copy_(torch.randn(self.kv.k_buffers[0].shape, generator=self.g))
        self.kv.v_buffers[0].copy_(torch.randn(self.kv.v_buffers[0].shape, generator=self.g))
        self.r2t = ReqToTokenPool(16, 2048)
        self.free_pages = (torch.randperm(pages, generator=self.g) + 1).tolist()  # page 0: padding

    def _slots(self, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            p = self.free_pages.pop()
            out += range(p * self.page, (p + 1) * self.page)
        return out[:n]

    def request(self, n: int, share_from: int | None = None, shared: int = 0) -> int:
        idx = self.r2t.alloc()
        assert idx is not None
        head = self.r2t.req_to_token[share_from, :shared].tolist() if share_from is not None else []
        self.r2t.write(idx, 0, head + self._slots(n - len(head)))
        return idx


def _batch(rpi: list[int], lens: list[int], ext: list[int], r2t: torch.Tensor) -> ForwardBatch:
    """``lens[i]`` tokens of request ``rpi[i]`` after this step, the last ``ext[i]`` of them new."""
    loc = torch.cat([r2t[r, n - e : n] for r, n, e in zip(rpi, lens, ext, strict=True)])
    pos = torch.cat([torch.arange(n - e, n) for n, e in zip(lens, ext, strict=True)])
    b = len(rpi)
    return ForwardBatch(
        input_ids=torch.zeros(len(loc), dtype=torch.int64), positions=pos, out_cache_loc=loc,
        req_pool_indices=torch.tensor(rpi), seq_lens=torch.tensor(lens),
        extend_prefix_lens=[n - e for n, e in zip(lens, ext, strict=True)], extend_seq_lens=list(ext),
        sampling=SamplingBatchInfo.greedy(b),
    )


def _compare(pool: Pool, fb: ForwardBatch, heads: int, seed: int, share_prefixes: bool = True,
             window: int | None = None) -> torch.Tensor:
    kvh, d = pool.kv.k_buffers[0].shape[1:]
    dtype = pool.kv.dtype
    g = torch.Generator().manual_seed(seed)
    T = fb.num_tokens
    q = torch.randn(T, heads, d, generator=g).to(dtype)
    k = torch.randn(T, kvh, d, generator=g).to(dtype)
    v = torch.randn(T, kvh, d, generator=g).to(dtype)
    ref_be = TorchNativeAttention(heads, kvh, d, window=window)
    ref_be.share_prefixes = share_prefixes and window is None
    ref = ref_be.forward(q, k, v, 0, fb, pool.kv, pool.r2t)
    got = create_attention_backend("cpu_paged", heads, kvh, d, window=window).forward(q, k, v, 0, fb, pool.kv, pool.r2t)
    assert got.dtype == ref.dtype and got.shape == ref.shape
    # errors relative to the output's scale (a long context averages V down to ~0.03): float32 is
    # exact up to summation order (seen: 6e-7); bfloat16 rounds the output, and torch also its
    # intermediates, to 8 bits of mantissa (seen: 5e-3)
    scale = ref.float().abs().max().item()
    tol = 1e-5 if dtype == torch.float32 else 1.5e-2
    torch.testing.assert_close(got.float(), ref.float(), atol=tol * scale, rtol=0)
    return got


DTYPES = [torch.float32, torch.bfloat16]


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize(("heads", "kvh"), [(9, 3), (3, 3)], ids=["gqa3", "gqa1"])
def test_ragged_decode_batch(dtype: torch.dtype, page: int, heads: int, kvh: int) -> None:
    pool = Pool(page, kvh, 64, dtype, pages=12000 // page, seed=page)
    lens = [1, 2, 15, 16, 17, 100, 255, 700, 1333, 2000, 64, 3]
    rpi = [pool.request(n) for n in lens]
    _compare(pool, _batch(rpi, lens, [1] * len(lens), pool.r2t.req_to_token), heads, seed=1)


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("page", [1, 16])
def test_shared_prefixes(dtype: torch.dtype, page: int) -> None:
    """Requests forked from one another (two prefix groups, one of them nested) against the torch
    backend with its cascade grouping on, and off."""
    pool = Pool(page, 3, 64, dtype, pages=12000 // page, seed=3)
    a = pool.request(600)
    rows = [(a, 600)]
    for n in (650, 601, 900):
        rows.append((pool.request(n, share_from=a, shared=576), n))  # whole pages shared
    b = pool.request(300)
    rows += [(b, 300), (pool.request(340, share_from=b, shared=288), 340), (pool.request(20), 20)]
    rpi, lens = [r for r, _ in rows], [n for _, n in rows]
    for share in (True, False):
        _compare(pool, _batch(rpi, lens, [1] * len(rows), pool.r2t.req_to_token), 9, seed=2, share_prefixes=share)


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("ctx", [2000, 2048])
def test_batch_one_long_context(dtype: torch.dtype, ctx: int) -> None:
    """One request over a long context: split across threads, merged by log-sum-exp."""
    pool = Pool(16, 3, 64, dtype, pages=200, seed=4)
    r = pool.request(ctx)
    _compare(pool, _batch([r], [ctx], [1], pool.r2t.req_to_token), 9, seed=3)


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_mixed_prefill_and_decode(dtype: torch.dtype) -> None:
    """Extend rows keep the torch path; the decode rows between them go to the kernel."""
    pool = Pool(16, 3, 64, dtype, pages=400, seed=5)
    lens = [40, 300, 17, 900, 5]
    ext = [1, 30, 1, 1, 5]
    rpi = [pool.request(n) for n in lens]
    _compare(pool, _batch(rpi, lens, ext, pool.r2t.req_to_token), 9, seed=4)


@needs_ext
@pytest.mark.parametrize(("heads", "kvh", "d"), [(8, 2, 128), (6, 2, 48), (10, 2, 32)])
def test_other_head_shapes(heads: int, kvh: int, d: int) -> None:
    """Head shapes with and without a specialised AVX-512 loop (the portable loop runs the rest)."""
    pool = Pool(16, kvh, d, torch.float32, pages=300, seed=6)
    lens = [1, 77, 800, 1500]
    rpi = [pool.request(n) for n in lens]
    _compare(pool, _batch(rpi, lens, [1] * len(lens), pool.r2t.req_to_token), heads, seed=5)


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("page", [1, 16])
def test_sliding_window_reads_only_the_window(dtype: torch.dtype, page: int) -> None:
    """Rows shorter and longer than the window (a long one split over threads), each against the
    torch backend's window; then every slot before a row's window is replaced by one outside the
    pool (which the kernel refuses to read) and the result is the same bits."""
    window = 300
    pool = Pool(page, 3, 64, dtype, pages=12000 // page, seed=8)
    lens = [1, 17, 299, 300, 301, 700, 2000, 64]
    rpi = [pool.request(n) for n in lens]
    fb = _batch(rpi, lens, [1] * len(lens), pool.r2t.req_to_token)
    got = _compare(pool, fb, 9, seed=6, window=window)
    for r, n in zip(rpi, lens, strict=True):
        pool.r2t.req_to_token[r, : max(0, n - window)] = 10**6
    be = create_attention_backend("cpu_paged", 9, 3, 64, window=window)
    g = torch.Generator().manual_seed(6)
    q = torch.randn(fb.num_tokens, 9, 64, generator=g).to(dtype)
    k, v = (torch.randn(fb.num_tokens, 3, 64, generator=g).to(dtype) for _ in range(2))
    assert torch.equal(be.forward(q, k, v, 0, fb, pool.kv, pool.r2t), got)


def test_a_backend_without_windows_or_capping_says_which() -> None:
    with pytest.raises(ValueError, match="no score soft-capping.*torch_native"):
        create_attention_backend("cpu_paged", 9, 3, 64, softcap=50.0)
    assert create_attention_backend("auto", 9, 3, 64, softcap=50.0).__class__ is TorchNativeAttention


@needs_ext
def test_slot_outside_the_pool_is_refused() -> None:
    pool = Pool(16, 3, 64, torch.float32, pages=10, seed=7)
    r = pool.request(40)
    pool.r2t.req_to_token[r, 7] = 10**6
    q = torch.randn(1, 9, 64)
    with pytest.raises(RuntimeError, match="outside the KV pool"):
        paged.paged_decode_attention(q, pool.kv.k_buffers[0], pool.kv.v_buffers[0], pool.r2t.req_to_token,
                                     torch.tensor([r]), torch.tensor([40]), 0.125)


def test_unbuildable_extension_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(paged, "_load", lambda: (None, "CalledProcessError: g++ not found"))
    with pytest.raises(RuntimeError, match="cpu_paged.*unavailable.*g\\+\\+ not found.*torch_native"):
        create_attention_backend("cpu_paged", 9, 3, 64)


# ------------------------------------------------------------------------------------------------
# The whole engine, real model, float32: same greedy tokens with either backend
# ------------------------------------------------------------------------------------------------


@pytest.mark.slow
@needs_ext
def test_engine_greedy_parity(fp32_runner: Any) -> None:
    from radixserve.engine import Engine

    text = ("A paged KV cache stores each request's keys and values in fixed-size pages, so memory is "
            "allocated as the sequence grows and shared prefixes can point at the same pages. ")
    ids = fp32_runner.tokenizer.encode(text * 12)
    # two share a long prefix (a radix-cache hit, so decode rows with shared slots), one is short
    prompts = [ids[:300], ids[:300] + ids[5:40], ids[7:60], ids[:9]]
    params = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}

    def run() -> list[list[int]]:
        eng = Engine(runner=fp32_runner, dtype="float32", max_total_tokens=4096)
        eng.generate(input_ids=prompts[0], sampling_params=params)  # cache the shared prefix
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        assert isinstance(outs, list)
        return [o["output_ids"] for o in outs]

    ref = run()
    model = fp32_runner.model
    old = model.attn_backend
    model.attn_backend = create_attention_backend("cpu_paged", old.num_heads, old.num_kv_heads, old.head_dim)
    try:
        got = run()
    finally:
        model.attn_backend = old
    assert got == ref


@needs_ext
def test_bench_attention_runs(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """``radixserve bench attention`` on tiny sizes: a row per configuration, backends timed."""
    import json

    from radixserve.cli import main

    out = tmp_path / "att.json"
    assert main(["bench", "attention", "--batch-sizes", "1,3", "--contexts", "40", "--iters", "2", "--rounds", "1",
                 "--stream-mb", "8", "--num-heads", "9", "--num-kv-heads", "3", "--head-dim", "64",
                 "--output", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [(r["batch"], r["ctx"], r["layers"]) for r in res["rows"]] == [(1, 40, 30), (3, 40, 30)]
    assert all(set(r["ms"]) == {"torch_native", "cpu_paged"} for r in res["rows"])
    assert res["rows"][1]["bytes"] == 3 * 40 * (2 * 3 * 64 * 2 + 8)
    assert all(r["read_only_ms"] > 0 for r in res["rows"])
    text = capsys.readouterr().out
    assert "STREAM-style copy" in text and "of floor" in text
    # the same batch scattered over a larger pool: same bytes to read, fewer layers fit the cap
    assert main(["bench", "attention", "--batch-sizes", "3", "--contexts", "40", "--iters", "2", "--rounds", "1",
                 "--stream-mb", "8", "--num-heads", "9", "--num-kv-heads", "3", "--head-dim", "64",
                 "--backends", "cpu_paged", "--pool-tokens", "40000", "--max-pool-mib", "100",
                 "--output", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["bytes"] == 3 * 40 * (2 * 3 * 64 * 2 + 8)
    assert row["layers"] == (100 << 20) // (40000 * 2 * 3 * 64 * 2)
    assert "a pool of 40000 slots per layer" in capsys.readouterr().out


@needs_ext
@pytest.mark.parametrize("page", [1, 16])
def test_read_kv_rows_reads_exactly_the_rows_attention_reads(page: int) -> None:
    """The memory floor of ``bench attention`` reads every K/V row of every request's tokens, and
    only those: its sum equals the same sum taken in torch over the rows the slot table names
    (per 32-bit word lane, wrapping, as the kernel adds them)."""
    pool = Pool(page, 3, 64, torch.bfloat16, pages=500 if page == 1 else 40, seed=9)
    lens = [1, 17, 300, 129]
    rpi = [pool.request(n) for n in lens]
    k, v, r2t = pool.kv.k_buffers[0], pool.kv.v_buffers[0], pool.r2t.req_to_token
    torch.set_num_threads(2)
    got = paged.extension().read_kv_rows(k, v, r2t, torch.tensor(rpi), torch.tensor(lens))
    slots = torch.cat([r2t[r, :n] for r, n in zip(rpi, lens, strict=True)])
    words = (k[slots].contiguous().view(torch.int32) ^ v[slots].contiguous().view(torch.int32)).view(-1, 16)
    lanes = (words.to(torch.int64) & 0xFFFFFFFF).sum(0)
    # each thread keeps its own 16 wrapping lanes; the sum over threads of (lane mod 2^32) can differ
    # from (total lane mod 2^32) only by multiples of 2^32
    want = int(lanes.sum())
    assert got <= want and (want - int(got)) % (1 << 32) == 0
    pool.r2t.req_to_token[rpi[2], 5] = 10**7
    with pytest.raises(RuntimeError, match="outside the KV pool"):
        paged.extension().read_kv_rows(k, v, r2t, torch.tensor(rpi), torch.tensor(lens))


@needs_ext
def test_bf16_dot_products_match_the_widening_path() -> None:
    """Where the CPU has AVX512-BF16 a bfloat16 pool is read with bfloat16 dot products; the build
    without them (what other CPUs run) gives the same outputs to bfloat16's tolerance, on a ragged
    batch with odd lengths (a lone last token in the pairwise P x V)."""
    if not paged.extension().has_bf16_dot():
        pytest.skip("this CPU has no AVX512-BF16: only the widening path is built")
    other, err = paged.variant("widen")
    assert other is not None, err
    assert not other.has_bf16_dot()
    pool = Pool(16, 3, 64, torch.bfloat16, pages=400, seed=5)
    lens = [1, 3, 16, 17, 255, 1333, 40]
    rpi = [pool.request(n) for n in lens]
    q = torch.randn(len(lens), 9, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    args = (q, pool.kv.k_buffers[0], pool.kv.v_buffers[0], pool.r2t.req_to_token, torch.tensor(rpi),
            torch.tensor(lens), 0.125)
    got, want = paged.extension().paged_decode_attention(*args), other.paged_decode_attention(*args)
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), atol=1.5e-2 * scale, rtol=0)


@pytest.mark.slow
@needs_ext
def test_plain_loops_match_the_vector_path() -> None:
    """The build without AVX-512 or AVX2 intrinsics (what other CPUs run, and any head shape the
    vector paths are not specialised on) gives the same outputs to float32 rounding, on a ragged
    batch with split rows and a short last block."""
    plain, err = paged.variant("plain")
    assert plain is not None, err
    pool = Pool(16, 3, 64, torch.float32, pages=400, seed=6)
    lens = [1, 3, 16, 17, 255, 1333, 40]
    rpi = [pool.request(n) for n in lens]
    q = torch.randn(len(lens), 9, 64, generator=torch.Generator().manual_seed(3))
    args = (q, pool.kv.k_buffers[0], pool.kv.v_buffers[0], pool.r2t.req_to_token, torch.tensor(rpi),
            torch.tensor(lens), 0.125)
    torch.testing.assert_close(paged.extension().paged_decode_attention(*args), plain.paged_decode_attention(*args),
                               atol=2e-5, rtol=1e-4)
