"""GGUF tensors to float32: csrc/gguf_dequant.cpp where it builds, ``gguf.quants`` otherwise.

The same extension multiplies by weights kept in their blocks (``linear``, gguf_blocks.py); on a
CPU with AVX512-VNNI, csrc/gguf_vnni.cpp does it with integer dot products for bfloat16 models.

The C++ dequantizers (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
IQ4_NL, IQ4_XS) reproduce gguf-py's reference bit for bit (same float32 operations in the same
order, no fused multiply-add: tests/model/test_dequant.py compares every type), in parallel over
blocks; gguf-py's numpy versions make several full-size temporaries per tensor. Any other type, or
a machine without a compiler, goes to ``gguf.quants.dequantize``.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from radixserve.model.cpp_build import load_extension

_SOURCE = Path(__file__).with_name("csrc") / "gguf_dequant.cpp"
_VNNI_SOURCE = Path(__file__).with_name("csrc") / "gguf_vnni.cpp"
_AMX8_SOURCE = Path(__file__).with_name("csrc") / "gguf_amx8.cpp"


@functools.lru_cache(maxsize=1)
def _ext() -> tuple[Any, str | None]:
    return load_extension("radixserve_gguf_dequant", _SOURCE, ["-ffp-contract=off"])


@functools.lru_cache(maxsize=1)
def _vnni() -> tuple[Any, str | None]:
    return load_extension("radixserve_gguf_vnni", _VNNI_SOURCE)


@functools.lru_cache(maxsize=1)
def _amx8() -> tuple[Any, str | None]:
    return load_extension("radixserve_gguf_amx8", _AMX8_SOURCE)


@functools.lru_cache(maxsize=1)
def amx8_ext() -> Any | None:
    """csrc/gguf_amx8.cpp (AMX int8 tiles whose result does not depend on the row count) where it
    builds and the CPU lets it use the tile registers; None elsewhere."""
    ext, _ = _amx8()
    return ext if ext is not None and ext.available() else None


def has_bf16_kernel() -> bool:
    """Whether ``linear`` has the AVX512-BF16 kernel for bfloat16 inputs (gguf_dequant.cpp)."""
    ext, _ = _ext()
    return ext is not None and bool(ext.has_bf16_kernel())


def has_amx_kernel() -> bool:
    """Whether ``linear`` multiplies bfloat16 inputs of up to a thousand rows by AMX tiles
    (gguf_dequant.cpp, built on a CPU with AMX-BF16, the kernel allowed its tile registers)."""
    ext, _ = _ext()
    return ext is not None and bool(ext.has_amx_kernel())


@functools.lru_cache(maxsize=1)
def vnni_ext() -> Any | None:
    """csrc/gguf_vnni.cpp (integer dot products on the blocks) where it builds with AVX512-VNNI."""
    ext, _ = _vnni()
    return ext if ext is not None and any(ext.supported(t) for t in range(64)) else None


def native_types() -> frozenset[int]:
    """The GGML type ids the C++ dequantizer handles here (empty without the extension)."""
    ext, _ = _ext()
    if ext is None:
        return frozenset()
    return frozenset(t for t in range(64) if ext.supported(t))


# the float types: kept as float tensors of the model's dtype, never as blocks
FLOAT_TYPES = frozenset({0, 1, 30})  # F32, F16, BF16


def block_shape(qtype: int) -> tuple[int, int]:
    """(values per block, bytes per block) of a GGML type."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    return int(block), int(size)


def block_types() -> frozenset[int]:
    """The quantized GGML types a weight can stay in here (its blocks read by ``linear``)."""
    return native_types() - FLOAT_TYPES


def linear_ext() -> Any:
    """The extension, or RuntimeError saying why it is unavailable (the caller asked for blocks)."""
    ext, err = _ext()
    if ext is None:
        raise RuntimeError(f"the GGUF block kernels are unavailable: {err}")
    return ext


def dequantize(data: np.ndarray, qtype: Any) -> np.ndarray:
    """The float32 values of a GGUF tensor's raw ``data`` (as ``gguf``'s reader gives it: blocks as
    uint8, or F32/F16/BF16 values), flat, in the file's order."""
    ext, _ = _ext()
    code = int(qtype)
    if ext is None or not ext.supported(code):
        from gguf import quants

        return np.asarray(quants.dequantize(data, qtype), dtype=np.float32).reshape(-1)
    flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    with warnings.catch_warnings():  # a read-only memmap of the file: the kernel only reads it
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        raw = torch.from_numpy(flat)
    return np.asarray(ext.dequantize(raw, code).numpy())


if __name__ == "__main__":  # python -m radixserve.model.dequant: build it now (scripts/setup.sh)
    import sys

    from radixserve.model.cpp_build import build_dir

    ext_, err_ = _ext()
    if ext_ is None:
        print(f"GGUF dequantizer: unavailable: {err_}")
        sys.exit(1)
    print(f"GGUF dequantizer: built in {build_dir()}")
    vnni_, verr = _vnni()
    print(f"GGUF VNNI kernel: {'built' if vnni_ is not None else 'unavailable: ' + str(verr)}"
          f"{'' if vnni_ is None or vnni_ext() is not None else ' (no AVX512-VNNI on this CPU: not used)'}")
    amx8_, aerr = _amx8()
    print(f"GGUF AMX int8 kernel: {'built' if amx8_ is not None else 'unavailable: ' + str(aerr)}"
          f"{'' if amx8_ is None or amx8_ext() is not None else ' (no AMX int8 on this CPU: not used)'}")
