"""Row buckets for oneDNN GEMMs (``gemm_rows``): few distinct shapes, bounded padding, the same
results. What the buckets are for, resident memory flat over thousands of request shapes, is
checked by ``radixserve bench soak`` (docs/reliability.md)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from radixserve.model import linear
from radixserve.model.linear import Linear, gemm_rows


def test_buckets_are_few_and_padding_bounded() -> None:
    seen = set()
    for m in range(1, 16385):
        r = gemm_rows(m)
        assert r >= m and gemm_rows(r) == r
        if m <= 16:
            assert r == m
        else:
            assert (r - m) / m <= 0.125
        seen.add(r)
    # 16 exact sizes, then 8 per power of two up to 2^14
    assert len(seen) == 16 + 8 * 10


def make_linear(dtype: torch.dtype, pack: bool) -> tuple[Linear, torch.Tensor, torch.Tensor]:
    """The layer, and its weight and bias in float32 for the reference."""
    lin = Linear(96, 200, bias=True, dtype=dtype)
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(200, 96, generator=g).to(dtype), torch.randn(200, generator=g).to(dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
        assert lin.bias is not None
        lin.bias.copy_(b)
    if pack and not lin.pack():
        pytest.skip("this torch build has no packed oneDNN linear")
    return lin, w.float(), b.float()


@pytest.mark.parametrize(
    ("dtype", "pack"), [(torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False), (torch.float32, False)]
)
def test_linear_runs_oneDNN_on_bucketed_rows(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, pack: bool) -> None:
    lin, w, b = make_linear(dtype, pack)
    ref = F.linear
    ref_packed = torch.ops.mkldnn._linear_pointwise
    rows_seen: list[int] = []

    def spy_linear(x: torch.Tensor, *args: Any) -> torch.Tensor:
        rows_seen.append(x.shape[0])
        return ref(x, *args)

    def spy_packed(x: torch.Tensor, *args: Any) -> torch.Tensor:
        rows_seen.append(x.shape[0])
        return ref_packed(x, *args)

    class Ops:
        class mkldnn:
            _linear_pointwise = staticmethod(spy_packed)

    monkeypatch.setattr(linear.F, "linear", spy_linear)
    if pack:
        monkeypatch.setattr(linear.torch, "ops", Ops)
    xs = {m: torch.randn(m, 96, generator=torch.Generator().manual_seed(m)).to(dtype) for m in (1, 16, 17, 37, 100, 513)}
    outs = {m: lin(x) for m, x in xs.items()}
    monkeypatch.undo()
    oneDNN = pack or dtype != torch.float32
    assert rows_seen == ([1, 16, 18, 40, 104, 576] if oneDNN else list(xs))
    for m, x in xs.items():
        assert outs[m].shape == (m, 200)
        want = F.linear(x.float(), w, b)
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        assert float((outs[m].float() - want).abs().max() / want.abs().max()) < tol
