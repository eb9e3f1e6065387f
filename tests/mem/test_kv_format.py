"""``--kv-cache-dtype``: what each format keeps of a row, and the pool's doors for it (write / read,
gather / scatter, bytes per token)."""

from __future__ import annotations

import pytest
import torch

from radixserve.mem.kv_format import KV_CACHE_DTYPES, kv_format
from radixserve.mem.kv_pool import KVPool

QUANTIZED = ["fp8_e4m3", "fp8_e5m2", "int8"]


def _rows(n: int = 64, heads: int = 3, dim: int = 64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, heads, dim, generator=g) * torch.linspace(0.01, 20, n).view(n, 1, 1)
    x[3] = 0  # a row of zeros (an int8 scale of 0)
    return x


def test_names() -> None:
    assert kv_format("auto", torch.bfloat16).storage == torch.bfloat16
    assert kv_format("auto", torch.float32).storage == torch.float32
    assert kv_format("bf16", torch.float32).name == kv_format("bfloat16", torch.float32).name == "bfloat16"
    assert kv_format("fp8", torch.float32) == kv_format("fp8_e4m3", torch.float32)  # vLLM's name
    for name in KV_CACHE_DTYPES:
        kv_format(name, torch.float32)
    with pytest.raises(ValueError, match="unknown KV cache dtype 'fp4'"):
        kv_format("fp4", torch.float32)


def test_int8_error_is_half_a_step_of_each_rows_scale() -> None:
    fmt = kv_format("int8", torch.float32)
    x = _rows()
    data, scales = fmt.encode(x)
    assert data.dtype == torch.int8 and scales is not None and scales.shape == (64, 3)
    back = fmt.decode(data, scales, torch.float32)
    step = x.abs().amax(-1, keepdim=True) / 127
    assert bool(((back - x).abs() <= step / 2 + 1e-6).all())
    assert not back[3].any()
    assert int(data.abs().max()) == 127  # each row's largest value maps to the end of the range


@pytest.mark.parametrize(("name", "bits"), [("fp8_e4m3", 3), ("fp8_e5m2", 2)])
def test_fp8_keeps_its_mantissa(name: str, bits: int) -> None:
    """Each value to its mantissa's rounding, small ones too: e4m3's row scale keeps 0.02 next to
    250 out of its subnormals (under 2^-6 without the scale)."""
    fmt = kv_format(name, torch.float32)
    x = torch.tensor([0.003 if name == "fp8_e5m2" else 0.02, 0.3, -1.7, 5.0, 123.0, -250.0])
    back = fmt.decode(*fmt.encode(x.view(1, 1, -1)), torch.float32).view(-1)
    assert bool(((back - x).abs() <= x.abs() * 2.0 ** -(bits + 1) * 1.0001).all())


def test_e5m2_saturates_and_e4m3_scales() -> None:
    big = torch.tensor([1e6, -1e6, 1.0]).view(1, 1, 3)
    e5 = kv_format("fp8_e5m2", torch.float32)
    assert e5.decode(*e5.encode(big), torch.float32).view(-1).tolist() == [e5.limit, -e5.limit, 1.0]
    e4 = kv_format("fp8_e4m3", torch.float32)
    data, scales = e4.encode(big)
    assert scales is not None and scales.item() == pytest.approx(1e6 / 448)
    assert e4.decode(data, scales, torch.float32).view(-1)[:2].tolist() == pytest.approx([1e6, -1e6])


@pytest.mark.parametrize("name", ["float32", "bf16", *QUANTIZED])
def test_pool_write_read_and_transfer(name: str) -> None:
    """What ``read`` returns is what ``decode`` makes of the stored row; ``gather`` from one pool and
    ``scatter`` into another (a transfer, a tier load) carries the stored bytes, scales included."""
    fmt = kv_format(name, torch.float32)
    a = KVPool(200, 4, 2, 3, 64, fmt)
    b = KVPool(200, 4, 2, 3, 64, fmt)
    k, v = _rows(seed=1), _rows(seed=2)
    loc = torch.randperm(200)[:64] + 4
    for layer in range(2):
        a.write(layer, loc, k * (layer + 1), v)
    got_k, got_v = a.read(1, loc, torch.float32)
    want_k = fmt.decode(*fmt.encode(k * 2), torch.float32)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, fmt.decode(*fmt.encode(v), torch.float32))
    parts = a.gather(loc.tolist())
    assert len(parts) == (8 if fmt.scaled else 4) and [p.shape[0] for p in parts] == [64] * len(parts)
    dst = (torch.randperm(200)[:64] + 4).tolist()
    assert b.scatter(dst, [bytearray(p.contiguous().view(torch.uint8).numpy()) for p in parts]) == 64 * a.bytes_per_token_here()
    for layer in range(2):
        for x, y in zip(a.read(layer, loc, torch.float32), b.read(layer, torch.tensor(dst), torch.float32), strict=True):
            assert torch.equal(x, y)
    with pytest.raises(ValueError, match="KV part 0 has"):
        b.scatter(dst[:10], [bytearray(p.contiguous().view(torch.uint8).numpy()) for p in parts])


def test_bytes_per_token() -> None:
    """One byte per value: half of bfloat16 for e5m2; int8 and e4m3 add a float32 scale per head and row."""
    layers, heads, dim = 30, 3, 64
    bf16 = KVPool.bytes_per_token(layers, heads, dim, torch.bfloat16)
    assert KVPool.bytes_per_token(layers, heads, dim, kv_format("fp8_e5m2", torch.bfloat16)) * 2 == bf16
    int8 = KVPool.bytes_per_token(layers, heads, dim, kv_format("int8", torch.bfloat16))
    assert int8 == 2 * layers * heads * (dim + 4)
    assert KVPool.bytes_per_token(layers, heads, dim, kv_format("fp8_e4m3", torch.bfloat16)) == int8
    pool = KVPool(16, 1, layers, heads, dim, kv_format("int8", torch.bfloat16))
    assert pool.bytes_per_token_here() == int8 and sum(pool.part_row_bytes()) == int8
