"""The C++ GGUF dequantizers against gguf-py's reference, bit for bit, for every type they take:
random blocks (every bit pattern of the packed integers and scales, float16 scales finite, some
subnormal), several rows. And the GGUF loader's weights are what the reference gives."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from radixserve.model.dequant import dequantize, native_types

# byte offsets of each block's float16 scales (ggml-common.h's layouts)
F16_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82),
    "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,),
}
BLOCK_TYPES = sorted(F16_FIELDS)


def _scales(rng: np.random.Generator, n: int) -> np.ndarray:
    """Finite float16 scales of both signs, normal and subnormal."""
    mag = np.exp2(rng.uniform(-26, 4, size=n)).astype(np.float16)
    return (mag * rng.choice([-1, 1], size=n)).astype(np.float16)


def random_blocks(name: str, rows: int, blocks_per_row: int, seed: int = 0) -> np.ndarray:
    qtype = GGMLQuantizationType[name]
    _, type_size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * blocks_per_row, type_size), dtype=np.uint8)
    for off in F16_FIELDS[name]:
        raw[:, off : off + 2] = _scales(rng, len(raw)).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, blocks_per_row * type_size)


def test_the_native_dequantizer_is_built_here() -> None:
    # the set-up installs a compiler; without one the loader falls back to gguf-py (slower, same values)
    assert {int(GGMLQuantizationType[n]) for n in [*BLOCK_TYPES, "F16", "BF16", "F32"]} <= native_types()


@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_block_types_equal_the_reference_bit_for_bit(name: str) -> None:
    qtype = GGMLQuantizationType[name]
    block = GGML_QUANT_SIZES[qtype][0]
    raw = random_blocks(name, rows=7, blocks_per_row=4096 // block)  # 4,096 columns, 7 rows
    want = np.asarray(quants.dequantize(raw, qtype), dtype=np.float32).reshape(-1)
    got = dequantize(raw, qtype)
    assert got.dtype == np.float32 and got.shape == want.shape
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), \
        f"{name}: {np.count_nonzero(got.view(np.uint32) != want.view(np.uint32))} values differ"


def test_float_types_equal_the_reference() -> None:
    rng = np.random.default_rng(1)
    values = (rng.standard_normal(3000) * np.exp2(rng.uniform(-30, 10, 3000))).astype(np.float32)
    for name, arr in (("F32", values), ("F16", values.astype(np.float16)),
                      ("BF16", (values.view(np.uint32) >> 16).astype(np.uint16))):
        qtype = GGMLQuantizationType[name]
        data = arr.view(np.uint8) if name == "BF16" else arr
        want = np.asarray(quants.dequantize(data, qtype), dtype=np.float32).reshape(-1)
        got = dequantize(data, qtype)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), name


def test_a_type_without_a_native_dequantizer_goes_to_the_reference() -> None:
    qtype = GGMLQuantizationType.TQ2_0
    assert int(qtype) not in native_types()
    _, type_size = GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(2).integers(0, 256, size=(2, 3 * type_size), dtype=np.uint8)
    raw[:, type_size - 2 :: type_size] = 0  # the float16 scale (each block's last 2 bytes): 0, finite
    raw[:, type_size - 1 :: type_size] = 0
    want = np.asarray(quants.dequantize(raw, qtype), dtype=np.float32).reshape(-1)
    assert np.array_equal(dequantize(raw, qtype), want)
