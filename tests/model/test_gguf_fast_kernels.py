"""The AVX-512 kernels a bfloat16 model's decode batches take on GGUF blocks: the VNNI integer
kernel (csrc/gguf_vnni.cpp, up to ``VNNI_MAX_ROWS`` rows), the bf16 row kernel and the AMX tile
kernel (csrc/gguf_dequant.cpp), each against the dequantized matrix for every type it reads, each
row the same whatever the batch, and ``GGUFWeight`` choosing between them and the tiles."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType

from radixserve.model.dequant import has_amx_kernel, has_bf16_kernel, linear_ext, vnni_ext
from radixserve.model.gguf_blocks import VNNI_MAX_ROWS, VNNI_MAX_ROWS_K, GGUFWeight, decode_rows
from tests.model.test_gguf_blocks import blocks_of

VNNI_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"]
BF16_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL"]

needs_vnni = pytest.mark.skipif(vnni_ext() is None, reason="no AVX512-VNNI on this CPU")
needs_bf16 = pytest.mark.skipif(not has_bf16_kernel(), reason="no AVX512-BF16 on this CPU")
needs_amx = pytest.mark.skipif(not has_amx_kernel(), reason="no AMX-BF16 on this CPU")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


@needs_vnni
@pytest.mark.parametrize("name", VNNI_TYPES)
def test_vnni_kernel_equals_the_dequantized_matmul(name: str) -> None:
    ext = vnni_ext()
    qtype = int(GGMLQuantizationType[name])
    # groups of 32 are taken in pairs, 8 to a span: 17 groups leave a short span with an odd group
    cols = 768 if ext.integer_scaled(qtype) else 544
    b = blocks_of(name, rows=41, cols=cols)
    w = b.dequantize().double()
    for rows in (1, 2, 3, 4, 5, 9, 33):  # up to 24: unpacked straight into the products; then buffered
        x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
        got = ext.linear(x, b.data, b.qtype)
        assert got.dtype == torch.float32 and got.shape == (rows, 41)
        # activations keep ~15 bits per 256 values: measured 1e-5 to 5e-5 of the largest output
        assert rel_err(got, x.double() @ w.t()) < 2e-4
        alone = torch.cat([ext.linear(x[i : i + 1], b.data, b.qtype) for i in range(rows)])
        assert torch.equal(alone, got)  # a row's result does not depend on its batch
        xb = x.to(torch.bfloat16)
        got_b = ext.linear(xb, b.data, b.qtype)
        assert got_b.dtype == torch.bfloat16 and rel_err(got_b, xb.double() @ w.t()) < 1e-2


@needs_vnni
def test_vnni_kernel_zero_and_non_finite_rows() -> None:
    ext = vnni_ext()
    b = blocks_of("Q4_K", rows=8, cols=256)
    x = torch.randn(3, 256)
    x[0] = 0.0
    x[2, 17] = float("nan")
    y = ext.linear(x, b.data, b.qtype)
    assert torch.equal(y[0], torch.zeros(8))
    assert torch.isfinite(y[1]).all() and torch.isnan(y[2]).all()  # NaN spreads as in float, to its row only
    with pytest.raises(RuntimeError, match="do not hold"):
        ext.linear(torch.randn(1, 512), b.data, b.qtype)
    with pytest.raises(RuntimeError, match="no VNNI kernel"):
        ext.linear(x, b.data, int(GGMLQuantizationType.Q2_K))
    assert not ext.supported(int(GGMLQuantizationType.Q2_K))


@needs_bf16
@pytest.mark.parametrize("name", BF16_TYPES)
def test_bf16_kernel_equals_the_bf16_weights_matmul(name: str) -> None:
    """Each weight row expanded to bf16 (the rounding bf16 float weights have), products summed in
    float32: within bf16 output rounding of the same matmul in float64, and batch invariant."""
    ext = linear_ext()
    b = blocks_of(name, rows=43, cols=512)  # not a multiple of 4 weight rows
    w = b.dequantize().to(torch.bfloat16).double()
    x = torch.randn(33, 512, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    full = ext.linear(x, b.data, b.qtype, 256)
    assert full.dtype == torch.bfloat16 and full.shape == (33, 43)
    assert rel_err(full, x.double() @ w.t()) < 8e-3  # measured 1-3e-3: the output's own bf16 rounding
    for rows in (1, 5, 7):
        assert torch.equal(ext.linear(x[:rows], b.data, b.qtype, 256), full[:rows])


@needs_amx
@pytest.mark.parametrize("name", BF16_TYPES)
def test_amx_kernel_equals_the_bf16_weights_matmul(name: str) -> None:
    """Weight rows expanded to bf16 32 at a time into AMX tiles: within bf16 output rounding of the
    same matmul in float64, for weight and input counts that fill no tile exactly, and each input
    row's result the same whatever the other rows of the call (small_rows -1: the AMX kernel at any
    number of rows, as a verify step asks)."""
    ext = linear_ext()
    cols = 768 if name.endswith("_K") else 544  # 17 chunks of 32: an odd count
    b = blocks_of(name, rows=45, cols=cols)  # one full block of 32 weight rows, one of 13
    w = b.dequantize().to(torch.bfloat16).double()
    x = torch.randn(1100, cols, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    x[7] = 0.0
    many = ext.linear(x, b.data, b.qtype, -1)  # past the kernel's own row limit, asked for anyway
    assert many.dtype == torch.bfloat16 and many.shape == (1100, 45)
    assert rel_err(many, x.double() @ w.t()) < 8e-3  # measured 1-3e-3: the output's own bf16 rounding
    assert torch.equal(many[7], torch.zeros(45, dtype=torch.bfloat16))
    for rows in (5, 16, 17, 33, 300):
        assert torch.equal(ext.linear(x[:rows], b.data, b.qtype, 0), many[:rows])
    assert torch.equal(ext.linear(x[40:41], b.data, b.qtype, -1), many[40:41])
    tiles = ext.linear(x, b.data, b.qtype, 0)  # 1100 rows: the GEMM on dequantized tiles
    assert rel_err(tiles, x.double() @ w.t()) < 8e-3


@needs_bf16
@pytest.mark.parametrize("name", BF16_TYPES)
def test_bf16_expansion_is_the_rounded_dequantization(name: str) -> None:
    """One-hot input rows read the expanded weights back exactly: both bf16 kernels expand every
    value to what ``dequantize().to(bfloat16)`` gives."""
    ext = linear_ext()
    cols = 512 if name.endswith("_K") else 160
    b = blocks_of(name, rows=37, cols=cols)
    want = b.dequantize().to(torch.bfloat16).t()
    eye = torch.eye(cols, dtype=torch.bfloat16)
    assert torch.equal(ext.linear(eye, b.data, b.qtype, cols), want)  # the bf16 row kernel
    if has_amx_kernel():
        assert torch.equal(ext.linear(eye, b.data, b.qtype, -1), want)  # the AMX tiles


@needs_vnni
@needs_bf16
def test_gguf_weight_picks_the_kernel_by_dtype_and_rows() -> None:
    ext, vnni = linear_ext(), vnni_ext()
    for name, limit in (("Q6_K", VNNI_MAX_ROWS_K), ("Q8_0", VNNI_MAX_ROWS)):  # the K-quants' scheme goes further
        b = blocks_of(name, rows=24, cols=256)
        weight = GGUFWeight([b], small_rows=16)
        assert weight.integer_kernel and weight.vnni_rows == limit
        for rows in (1, limit):
            x = torch.randn(rows, 256).to(torch.bfloat16)
            assert torch.equal(weight(x), vnni.linear(x, b.data, b.qtype))
        x = torch.randn(limit + 1, 256).to(torch.bfloat16)
        assert torch.equal(weight(x), ext.linear(x, b.data, b.qtype, 16))  # the bf16 row kernel
        with decode_rows(limit):  # a verify step of `limit` requests: its rows compute decode rows' numbers
            assert torch.equal(weight(x), vnni.linear(x, b.data, b.qtype))
        x = torch.randn(17, 256).to(torch.bfloat16)
        assert torch.equal(weight(x), ext.linear(x, b.data, b.qtype, 0))  # past small_rows: the tiles
        x32 = torch.randn(2, 256)
        assert torch.equal(weight(x32), ext.linear(x32, b.data, b.qtype, 16))  # float32 keeps the float kernel
    mixed = GGUFWeight([blocks_of("Q4_K", rows=8, cols=256), blocks_of("Q8_0", rows=8, cols=256)], small_rows=16)
    assert mixed.vnni_rows == VNNI_MAX_ROWS  # a part without the K scheme: the smaller limit for all


@pytest.mark.parametrize("amx", [False, True])
def test_bf16_models_default_rows_follow_the_kernel(monkeypatch: pytest.MonkeyPatch, amx: bool) -> None:
    import radixserve.model.host as host
    from radixserve.model.quant import (
        DEFAULT_BLOCK_ROWS,
        DEFAULT_BLOCK_ROWS_AMX,
        DEFAULT_BLOCK_ROWS_AMX_KERNEL,
        DEFAULT_BLOCK_ROWS_BF16,
        DEFAULT_BLOCK_ROWS_BF16_NO_KERNEL,
        default_max_rows,
    )

    flags = {"avx512f", "avx512_bf16"} | ({"amx_tile", "amx_bf16"} if amx else set())
    monkeypatch.setattr(host, "cpu_flags", lambda: flags)
    if not has_bf16_kernel():
        want = DEFAULT_BLOCK_ROWS_BF16_NO_KERNEL
    elif has_amx_kernel():  # the extension's own AMX kernel: built only where the CPU has AMX
        want = DEFAULT_BLOCK_ROWS_AMX_KERNEL
    else:
        want = DEFAULT_BLOCK_ROWS_AMX if amx else DEFAULT_BLOCK_ROWS_BF16
    assert default_max_rows(torch.bfloat16, in_blocks=True) == want
    assert default_max_rows(torch.float32, in_blocks=True) == DEFAULT_BLOCK_ROWS


def test_a_verify_step_takes_the_kernels_of_its_decode_step() -> None:
    """Under ``decode_rows(n)`` the choice between the row kernels and the tiled GEMM follows the n
    requests, not the rows: verifying drafted tokens computes what decoding them would."""
    ext = linear_ext()
    paths: list[str] = []

    class Spy:  # which path the block extension's linear was asked to take
        def linear(self, x: torch.Tensor, data: torch.Tensor, qtype: int, small_rows: int) -> torch.Tensor:
            paths.append("rows" if x.shape[0] <= small_rows else "tiles")
            return ext.linear(x, data, qtype, small_rows)

    b = blocks_of("Q8_0", rows=16, cols=256)  # VNNI_MAX_ROWS: the rows past it are the bf16 row kernel's
    weight = GGUFWeight([b], small_rows=VNNI_MAX_ROWS + 2)
    weight._ext = Spy()
    x = torch.randn(3 * (VNNI_MAX_ROWS + 1), 256, dtype=torch.bfloat16)
    with decode_rows(VNNI_MAX_ROWS + 1):  # more rows than small_rows, requests within it: row kernels
        weight(x)
    with decode_rows(VNNI_MAX_ROWS + 3):  # requests past small_rows: the tiles, whatever the rows
        weight(x[:2])
    weight(x)  # no decode step: by its rows
    weight(x[:VNNI_MAX_ROWS + 2])
    assert paths == ["rows", "tiles", "tiles", "rows"]
    if weight.integer_kernel:  # requests within the VNNI rows: the integer kernel for every row
        with decode_rows(2):
            assert torch.equal(weight(x), vnni_ext().linear(x, b.data, b.qtype))
        assert len(paths) == 4
