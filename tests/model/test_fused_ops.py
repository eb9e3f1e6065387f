"""The fused C++ small ops (fused_ops.py) against the torch reference, op by op and in the model.

Tolerances, per op (random shapes, rows on one thread and on several, widths that leave a tail
past the last full vector):

- residual add and RoPE: bit-exact in float32 and bfloat16 (same roundings, no FMA contraction);
- RMSNorm (with or without the add): float32 within 1e-6 relative (the sum of squares is added in
  another order), bfloat16 within one rounding step (2^-7 relative), on under 1% of the values;
- SiLU x up: the kernel's own exp, float32 within 1e-6 relative, bfloat16 as RMSNorm.

The whole model, the same batch through both: float32 logits within 1e-5 relative with the same
greedy tokens, bfloat16 within 2e-2 of the largest logit.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from kvharness import Harness

from radixserve.model import fused_ops

_ERR = fused_ops.extension_error()
pytestmark = pytest.mark.skipif(_ERR is not None, reason=f"fused ops extension could not be built: {_ERR}")

DTYPES = [torch.float32, torch.bfloat16]
ROWS = [0, 1, 5, 64, 300]  # 300 rows of these widths split over threads


@pytest.fixture(scope="module")
def ops() -> tuple[fused_ops.CppOps, fused_ops.TorchOps]:
    return fused_ops.CppOps(), fused_ops.TorchOps()


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32: 1e-6 relative; bfloat16: one rounding step, on under 1% of the values."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        return
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-30)
    assert (got != want).sum().item() <= max(1, want.numel() // 100)


def rand(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n", [576, 100, 37])
def test_rms_norm_and_add(ops: Any, dtype: torch.dtype, rows: int, n: int) -> None:
    cpp, ref = ops
    x = rand(rows, n, dtype=dtype, seed=rows + n, scale=3.0)
    w = rand(n, dtype=dtype, seed=1)
    close(cpp.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5))
    wide = rand(rows, 2 * n, dtype=dtype, seed=2)  # a view with a row stride: as the model's GEMM outputs
    res_a = rand(rows, n, dtype=dtype, seed=3)
    res_b = res_a.clone()
    got = cpp.add_rms_norm(wide[:, :n], res_a, w, 1e-5)
    want = ref.add_rms_norm(wide[:, :n], res_b, w, 1e-5)
    assert torch.equal(res_a, res_b)  # the residual stream is bit-exact
    close(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (4, 2, 16), (2, 1, 40)])
def test_rope_in_place_is_exact(ops: Any, dtype: torch.dtype, rows: int, heads: int, kv_heads: int, d: int) -> None:
    cpp, ref = ops
    qkv = rand(rows, (heads + 2 * kv_heads) * d, dtype=dtype, seed=rows * d + heads)
    orig = qkv.clone()
    cos = rand(rows, d // 2, dtype=dtype, seed=5)
    sin = rand(rows, d // 2, dtype=dtype, seed=6)
    qk = qkv[:, : (heads + kv_heads) * d].view(rows, heads + kv_heads, d)  # q and k, inside qkv
    want = ref.rope(orig[:, : (heads + kv_heads) * d].view(rows, heads + kv_heads, d), cos, sin)
    got = cpp.rope(qk, cos, sin)
    assert got.data_ptr() == qkv.data_ptr()  # rotated in place
    assert torch.equal(got, want)
    assert torch.equal(qkv[:, (heads + kv_heads) * d :], orig[:, (heads + kv_heads) * d :])  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n", [1536, 151])
def test_silu_mul(ops: Any, dtype: torch.dtype, rows: int, n: int) -> None:
    cpp, ref = ops
    gu = rand(rows, 2 * n, dtype=dtype, seed=rows + n, scale=4.0)
    close(cpp.silu_mul(gu), ref.silu_mul(gu))


def test_silu_mul_extremes(ops: Any) -> None:
    """exp's range ends: silu(-inf..-100) is -0 or a tiny negative, silu(large) is the input, NaN
    stays NaN; the same as torch's to float32 rounding."""
    cpp, ref = ops
    g = torch.tensor([-1e30, -150.0, -104.0, -88.0, -20.0, -1e-30, 0.0, 1e-30, 20.0, 88.0, 104.0, 1e30,
                      float("nan"), 3.0, -3.0, 0.5])
    gu = torch.cat([g, torch.full_like(g, 2.0)]).view(1, -1)
    got, want = cpp.silu_mul(gu), ref.silu_mul(gu)
    assert torch.isnan(got[0, 12]) and torch.isnan(want[0, 12])
    keep = ~torch.isnan(want)
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("rows", [1, 3, 40])
@pytest.mark.parametrize("n", [1, 15, 16, 49152, 1000003])
def test_argmax_rows_picks_what_torch_picks(rows: int, n: int) -> None:
    """Greedy sampling's argmax: the same index as torch's, ties (the first), -inf rows, NaN (the
    first NaN) and maxima in the vector part or the tail of a row included."""
    x = rand(rows, n, dtype=torch.float32, seed=n + rows)
    x[0, n // 2] = x[0, n - 1] = 9.0  # a tie, across the vector part and the tail
    if rows > 1:
        x[1] = float("-inf")
    if rows > 2:
        x[2, n // 3] = float("nan")
        x[2, n - 1] = float("nan")
        x[2, 0] = float("inf")
    assert torch.equal(fused_ops.argmax_rows(x), x.argmax(dim=-1))
    assert torch.equal(fused_ops.argmax_rows(x[:, : max(1, n // 2)]), x[:, : max(1, n // 2)].argmax(dim=-1))
    assert torch.equal(fused_ops.argmax_rows(torch.empty(0, n)), torch.empty(0, n).argmax(dim=-1))


Steps = list[list[list[int]]]


def _model_logits(runner: Any, ops_name: str, steps: Steps) -> tuple[list[torch.Tensor], Steps]:
    """Run ``steps`` (the prompts, then one token per request per step; ``[]`` after the prompts:
    decode the greedy tokens of the step before) through the model with ``ops_name``; returns each
    step's logits and the tokens it fed."""
    model = runner.model
    before = model.small_ops
    kv = runner.make_kv_pool(4096, page_size=16)
    r2t = runner.make_req_to_token_pool(8, 1024)
    runner.attach_pools(kv, r2t)
    h = Harness(kv, r2t)
    reqs = [h.new_request() for _ in steps[0]]
    out: list[torch.Tensor] = []
    fed: Steps = []
    try:
        model.set_small_ops(ops_name)
        with torch.inference_mode():
            for toks in steps:
                toks = toks or [[int(t)] for t in out[-1].argmax(-1)]
                fed.append(toks)
                out.append(model(h.batch(reqs, toks), kv, r2t).float())
    finally:
        model.small_ops = before
    return out, fed


def test_model_float32_same_logits_and_tokens(fp32_runner: Any) -> None:
    prompts = [list(range(10, 60)), list(range(100, 103)), list(range(7, 300, 3))]
    ref, fed = _model_logits(fp32_runner, "torch", [prompts] + [[]] * 4)
    got, _ = _model_logits(fp32_runner, "cpp", fed)
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        assert float((a - b).abs().max() / b.abs().max()) < 1e-5


def test_model_bfloat16_tiny(tmp_path: Any) -> None:
    """A tiny random Llama in bfloat16 (odd intermediate size, head_dim 16): tails and GQA."""
    from radixserve.model.model_runner import ModelRunner
    from tests.model.tiny_llama import make_tiny_llama

    runner = ModelRunner(make_tiny_llama(str(tmp_path)), dtype="bfloat16", attention_backend="cpu_paged",
                         progress=False)
    assert runner.model.small_ops.name == "cpp"  # cpu_paged brings the C++ ops
    prompts = [list(range(40, 90)), list(range(1, 4))]
    ref, fed = _model_logits(runner, "torch", [prompts] + [[]] * 3)
    got, _ = _model_logits(runner, "cpp", fed)  # the reference's tokens: a near-tie cannot fork them
    for a, b in zip(got, ref, strict=True):
        assert float((a - b).abs().max() / b.abs().max()) < 2e-2


def test_torch_native_keeps_the_reference(tmp_path: Any) -> None:
    from radixserve.model.model_runner import ModelRunner
    from tests.model.tiny_llama import make_tiny_llama

    runner = ModelRunner(make_tiny_llama(str(tmp_path)), dtype="float32", attention_backend="torch_native",
                         progress=False)
    assert runner.model.small_ops.name == "torch"

