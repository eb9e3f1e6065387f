"""csrc/gguf_amx8.cpp: GGUF blocks packed for AMX int8 tiles, and the kernel whose result for a row
does not depend on the other rows of the call. The packing is checked on every machine (read back
in Python, it is the dequantized matrix); the kernel where the CPU has AMX int8."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve.model.dequant import _amx8, amx8_ext
from tests.model.test_gguf_blocks import blocks_of

TYPES = ["Q4_0", "Q4_1", "Q8_0"]

needs_amx8 = pytest.mark.skipif(amx8_ext() is None, reason="no AMX int8 on this CPU (or no compiler)")


def packer():
    ext, err = _amx8()
    if ext is None:
        pytest.skip(f"the AMX int8 extension does not build here: {err}")
    return ext


def unpacked(packed: torch.Tensor, name: str, rows: int, cols: int) -> torch.Tensor:
    """The float32 matrix a packed weight holds, read back as the layout says (gguf_amx8.cpp)."""
    bits, offset = (8, False) if name == "Q8_0" else (4, name == "Q4_1")
    payload = 512 if bits == 8 else 256
    rec = payload + 32 + (32 if offset else 0)
    groups = cols // 32
    p = packed.numpy().reshape(packed.shape[0], groups, rec)
    if bits == 8:
        b = p[:, :, :512].view(np.int8).astype(np.int32)
    else:
        nib = p[:, :, :256].astype(np.int32)
        b = np.concatenate([nib & 15, nib >> 4], axis=2)
        if name == "Q4_0":
            b = np.where(b >= 8, b - 16, b)
    # B byte (k // 4) * 64 + c * 4 + k % 4 is input k of the block's row c
    vals = b.reshape(-1, groups, 8, 16, 4).transpose(0, 3, 1, 2, 4).reshape(-1, groups, 32).astype(np.float32)
    d = p[:, :, payload:payload + 32].copy().view(np.float16).astype(np.float32).reshape(-1, 1, 16)
    d = d.reshape(-1, groups, 16).transpose(0, 2, 1).reshape(-1, groups, 1)
    w = vals * d
    if offset:
        m = p[:, :, payload + 32:payload + 64].copy().view(np.float16).astype(np.float32)
        w = w + m.reshape(-1, groups, 16).transpose(0, 2, 1).reshape(-1, groups, 1)
    return torch.from_numpy(w.reshape(-1, cols)[:rows])


@pytest.mark.parametrize("name", TYPES)
def test_packing_holds_the_dequantized_matrix(name: str) -> None:
    ext = packer()
    b = blocks_of(name, rows=37, cols=320)  # a partial block of 16 rows; 10 groups
    packed = ext.pack(b.data.contiguous(), b.qtype)
    record = {"Q4_0": 256 + 32, "Q4_1": 256 + 64, "Q8_0": 512 + 32}[name]  # payload, d (and m) per group
    assert packed.shape == (3, 10 * record)
    # as large as the file's blocks, rows rounded up to 16
    assert packed.numel() == 3 * 16 * b.data.shape[1]
    assert torch.equal(unpacked(packed, name, 37, 320), b.dequantize())


def test_packing_refuses_what_it_does_not_hold() -> None:
    ext = packer()
    b = blocks_of("Q4_K", rows=16, cols=256)
    assert not ext.supported(b.qtype)
    with pytest.raises(RuntimeError, match="no AMX int8 packing"):
        ext.pack(b.data.contiguous(), b.qtype)


@needs_amx8
@pytest.mark.parametrize("name", TYPES)
def test_kernel_equals_the_dequantized_matmul_and_rows_are_independent(name: str) -> None:
    ext = amx8_ext()
    # 1,600 inputs: six whole spans of 256 and a short one; 41 rows: a partial block
    b = blocks_of(name, rows=41, cols=1600)
    w = b.dequantize().double()
    packed = ext.pack(b.data.contiguous(), b.qtype)
    x = torch.randn(ext.max_rows(), 1600, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    want = x.double() @ w.t()
    outs = {m: ext.linear(x[:m].float(), packed, b.qtype, 41, 1600) for m in range(1, ext.max_rows() + 1)}
    full = outs[ext.max_rows()]
    assert full.dtype == torch.float32 and full.shape == (ext.max_rows(), 41)
    # activations keep ~15 bits: the error is that of rounding them, far below the weights' own
    err = float((full.double() - want).norm() / want.norm())
    assert err < 2e-4, err
    for m, y in outs.items():  # with or without the row of ones, alone or among 8: the same bits
        assert torch.equal(y, full[:m]), m
    # bfloat16 inputs holding the same values: the same result, rounded to bfloat16
    got = ext.linear(x, packed, b.qtype, 41, 1600)
    assert got.dtype == torch.bfloat16 and torch.equal(got, full.to(torch.bfloat16))


@needs_amx8
def test_kernel_refuses_bad_calls() -> None:
    ext = amx8_ext()
    b = blocks_of("Q8_0", rows=16, cols=256)
    packed = ext.pack(b.data.contiguous(), b.qtype)
    with pytest.raises(RuntimeError, match="1 to"):
        ext.linear(torch.randn(ext.max_rows() + 1, 256), packed, b.qtype, 16, 256)
    with pytest.raises(RuntimeError, match="not this weight"):
        ext.linear(torch.randn(1, 256), packed[:, :-1].contiguous(), b.qtype, 16, 256)


@needs_amx8
def test_gguf_weight_takes_the_tiles_for_decode_rows_and_drafts() -> None:
    from radixserve.model.gguf_blocks import GGUFWeight, decode_rows

    q41, q80 = blocks_of("Q4_1", rows=24, cols=512), blocks_of("Q8_0", rows=40, cols=512)
    w = GGUFWeight([q41, q80], small_rows=4)
    plain = GGUFWeight([q41, q80], small_rows=4)
    assert w.pack_tiles() and len(w.tiles) == 2 and w.nbytes > plain.nbytes
    x = torch.randn(11, 512, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    alone = torch.cat([w(x[i : i + 1]) for i in range(11)])
    with decode_rows(2):  # a verify step of 2 requests and 9 drafts: 11 rows, 8 a call
        together = w(x)
    assert together.dtype == torch.bfloat16 and torch.equal(together, alone)
    want = x.double() @ torch.cat([q41.dequantize(), q80.dequantize()]).double().t()
    assert float((together.double() - want).norm() / want.norm()) < 5e-3  # bf16 output rounding
    # past the decode rows the tiles' kernel is not used: the AMX bf16 kernel, as before
    assert torch.equal(w(x[:6]), plain(x[:6]))
    assert not GGUFWeight([blocks_of("Q4_K", rows=16, cols=256)], small_rows=4).pack_tiles()
