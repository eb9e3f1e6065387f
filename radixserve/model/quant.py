"""Weight-only quantized linears for CPU decode (``--quantization``).

At small batches a decode step streams every weight from memory once; storing them in fewer bits
reads fewer bytes. Activations stay in floating point; only the weight matrix is quantized:

- ``int8``: one symmetric scale per output row, ``w = q * s`` with ``q`` in [-127, 127], run by
  ``torch._weight_int8pack_mm`` (ATen's vectorized CPU kernel). A quarter of float32's bytes.
- ``int4``: asymmetric groups of 32 along the input dimension, ``w = q * s + m`` with ``q`` in
  [0, 15], run by ``torch._weight_int4pack_mm_for_cpu`` (tinygemm layout: it computes
  ``(q - 8) * s + z``, so ``z = m + 8 s``). That is exactly GGUF's Q4_1 block format, so a Q4_1
  weight that was dequantized at load is quantized back to the file's own 4-bit values; only
  ``s`` and ``z``, which the kernel takes in bfloat16, are rounded (Q4_1 stores them in float16).
  An eighth of float32's bytes (plus a scale and a zero per 32 weights).

Both kernels run in bfloat16 (their float32 paths are several times slower here); the input is cast
to bfloat16 and the output back, so a float32 model's activations are rounded to bfloat16 at each
quantized GEMM. The error budget this leaves is stated and tested in docs/model.md.

Past ``max_rows`` rows (prefill, large decode batches) the GEMM is compute-bound, and these
kernels are slower than oneDNN's float GEMM; there the layer keeps its float weights and runs
those. The quantized copy is what small batches read (``QuantizedWeight.__call__``).
"""

from __future__ import annotations

from typing import Final

import torch

QUANTIZATIONS: Final = ("none", "int8", "int4")
INT4_GROUP: Final = 32  # GGUF Q4_0/Q4_1 block size
# Rows up to which the quantized kernel beats the float GEMM (measured: docs/benchmarks.md).
DEFAULT_MAX_ROWS: Final = 8
COMPUTE_DTYPE: Final = torch.bfloat16


def check_quantization(name: str) -> str:
    if name not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {name!r}; use one of {', '.join(QUANTIZATIONS)}")
    return name


class QuantizedWeight:
    """A ``[out, in]`` weight in a quantized layout and the matmul that reads it."""

    method: str

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:  # pragma: no cover - abstract
        """The float32 ``[out, in]`` matrix this layout represents (for tests and checks)."""
        raise NotImplementedError

    @property
    def nbytes(self) -> int:  # pragma: no cover - abstract
        raise NotImplementedError


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).to(COMPUTE_DTYPE)


class Int8Weight(QuantizedWeight):
    method = "int8"

    def __init__(self, w: torch.Tensor) -> None:
        wf = w.detach().float()
        # the kernel takes the scales in bfloat16: round them up (never below the row's max / 127,
        # so no weight clips) and quantize against the rounded value the kernel will use
        scale = (wf.abs().amax(dim=1) / 127.0 * (1 + 2**-8)).clamp(min=1e-12).to(COMPUTE_DTYPE)
        self.q = torch.round(wf / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
        self.scale = scale

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch._weight_int8pack_mm(_rows(x), self.q, self.scale)
        return y.to(x.dtype).reshape(*x.shape[:-1], -1)

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale.float()[:, None]

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * self.scale.element_size()


def int4_groups(w: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, scale, min)``: Q4_1-style asymmetric quantization of ``[out, in]`` in groups of ``group``
    input columns; ``q`` int32 ``[out, in]`` in [0, 15], ``scale`` and ``min`` ``[out, in / group]``."""
    n, k = w.shape
    if k % group:
        raise ValueError(f"int4 needs the input size ({k}) to be a multiple of {group}")
    wg = w.detach().float().reshape(n, k // group, group)
    lo = wg.amin(dim=-1)
    scale = (wg.amax(dim=-1) - lo) / 15.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((wg - lo[..., None]) / safe[..., None]).clamp_(0, 15).to(torch.int32)
    return q.reshape(n, k), scale, lo


class Int4Weight(QuantizedWeight):
    method = "int4"

    def __init__(self, w: torch.Tensor, group: int = INT4_GROUP) -> None:
        n, k = w.shape
        q, scale, lo = int4_groups(w, group)
        self.group = group
        self.out_features, self.in_features = n, k
        self.packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
        zero = lo + 8.0 * scale  # tinygemm dequantizes (q - 8) * s + z
        self.scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(COMPUTE_DTYPE)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch._weight_int4pack_mm_for_cpu(_rows(x), self.packed, self.group, self.scales_zeros)
        return y.to(x.dtype).reshape(*x.shape[:-1], -1)

    def dequantize(self) -> torch.Tensor:
        # the kernel's own result on an identity input is the matrix it holds (transposed)
        eye = torch.eye(self.in_features, dtype=COMPUTE_DTYPE)
        return torch._weight_int4pack_mm_for_cpu(eye, self.packed, self.group, self.scales_zeros).float().t()

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + self.scales_zeros.numel() * 2


def quantize_weight(w: torch.Tensor, method: str) -> QuantizedWeight:
    if method == "int8":
        return Int8Weight(w)
    if method == "int4":
        return Int4Weight(w)
    raise ValueError(f"no quantized layout for {method!r}")
