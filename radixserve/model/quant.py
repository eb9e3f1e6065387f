"""Weight-only quantized linears for CPU decode (``--quantization``).

At small batches a decode step streams every weight from memory once; storing them in fewer bits
reads fewer bytes. Activations stay in floating point; only the weight matrix is quantized:

Two kernels, chosen per process (``block_kernel_error``):

``BlockWeight`` (csrc/block_gemm.cpp, where the CPU has AVX512-VNNI): GGUF's own block formats,
groups of 32 input columns with a float16 scale ``d`` and minimum ``m``, ``w = u * d + m``:

- ``int4``: GGUF Q4_1, ``u`` in [0, 15]. A Q4_1 weight that was dequantized at load is quantized
  back to the file's own 4-bit values, scales and minimums exactly.
- ``int8``: GGUF Q8_0, ``w = q * d`` with ``q`` in [-127, 127] (stored as ``u = q + 128`` with
  ``m = -128 d``). The bundled file's embedding (the tied LM head) is Q8_0: it comes back exactly.

The kernel quantizes each input row per block of 32 in two int8 passes (llama.cpp's one, then its
rounding error at 1/256 the step: ~15 bits) and sums integer products with VNNI; it reads the
weights once per call at close to memory speed.

The ATen fallback (no VNNI, or no compiler):

- ``Int8Weight``: one symmetric scale per output row, run by ``torch._weight_int8pack_mm``.
- ``Int4Weight``: the same Q4_1 groups, run by ``torch._weight_int4pack_mm_for_cpu`` (tinygemm
  layout: it computes ``(q - 8) * s + z``, so ``z = m + 8 s``; ``s`` and ``z`` rounded to bfloat16).

Both ATen kernels run in bfloat16 (their float32 paths are several times slower here); the input is
cast to bfloat16 and the output back. So either way a quantized GEMM rounds its input (to int8 per
block, or to bfloat16); the error budget this leaves is stated and tested in docs/model.md.

Past ``max_rows`` rows (prefill, large decode batches) the GEMM is compute-bound, and these
kernels are slower than oneDNN's float GEMM; there the layer keeps its float weights and runs
those. The quantized copy is what small batches read (``QuantizedWeight.__call__``).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Final

import torch

from radixserve.model.cpp_build import load_extension

QUANTIZATIONS: Final = ("auto", "none", "gguf", "int8", "int4")
INT4_GROUP: Final = 32  # GGUF Q4_0/Q4_1 block size
# Rows up to which the quantized kernels beat the float GEMM, by the float weights' dtype
# (measured: docs/benchmarks.md, whole decode steps alternated): against float32 weights (4 bytes
# each) the quantized steps won at 4 rows (0.61x) and were even at 16; against bfloat16 (2 bytes,
# AVX512-BF16 GEMMs) the block kernel won up to 5 rows (0.95x) and lost from 6 (1.03-1.08x).
DEFAULT_MAX_ROWS: Final = 8
DEFAULT_MAX_ROWS_BF16: Final = 5
# GGUF blocks read in place (gguf_blocks.py): up to this many rows the row-at-a-time kernel beats
# dequantized tiles through the GEMM. Measured in float32 on an AVX2 host (every layer of the
# bundled model, both paths, one after the other): 113 vs 122 ms at 32 rows, 226 vs 349 at 64,
# 259 vs 226 at 96, 732 vs 511 at 256. In bfloat16 with AVX512-BF16 the kernel expands each weight
# row into bf16 dot products: even with the tiles at 256 rows of one 576 x 3072 projection (5.4 vs
# 5.3 ms), behind them at 512 (6.3 vs 5.7); without it the bf16 tiles win from a few rows.
# With AMX the GEMM's bf16 tiles are several times faster and the tiles win from about a dozen rows:
# every linear of the bundled model in its Q4_1, Q8_0 and Q4_K_M requantizations, bf16, best of 5
# (Xeon with AMX, 2 threads; row kernels vs tiles): 33-38 vs 38-48 ms at 8 rows, 40-43 vs 36-37 at 12,
# 78 vs 42 at 32 (scripts/bench_block_rows.py).
DEFAULT_BLOCK_ROWS: Final = 64
DEFAULT_BLOCK_ROWS_BF16: Final = 256
DEFAULT_BLOCK_ROWS_AMX: Final = 10
# With gguf_dequant.cpp's own AMX kernel (weights expanded into tiles that stay in cache, no GEMM
# library) the tiles win from 5 rows: every linear, bundled model in Q4_K_M / Q8_0, 4 rows 1.00x /
# 1.00x the row kernels' time, 5 rows 0.78x / 0.73x, 8 rows 0.56x.
DEFAULT_BLOCK_ROWS_AMX_KERNEL: Final = 4
DEFAULT_BLOCK_ROWS_BF16_NO_KERNEL: Final = 8
COMPUTE_DTYPE: Final = torch.bfloat16


def default_max_rows(dtype: torch.dtype, in_blocks: bool = False) -> int:
    """The default ``--quantization-max-batch`` for a model whose float weights are ``dtype`` (or,
    ``in_blocks``, whose GGUF blocks are read in place and whose activations are ``dtype``)."""
    if in_blocks:
        if dtype != torch.bfloat16:
            return DEFAULT_BLOCK_ROWS
        from radixserve.model.dequant import has_amx_kernel, has_bf16_kernel
        from radixserve.model.host import cpu_flags

        if not has_bf16_kernel():
            return DEFAULT_BLOCK_ROWS_BF16_NO_KERNEL
        if has_amx_kernel():
            return DEFAULT_BLOCK_ROWS_AMX_KERNEL
        return DEFAULT_BLOCK_ROWS_AMX if "amx_bf16" in cpu_flags() else DEFAULT_BLOCK_ROWS_BF16
    return DEFAULT_MAX_ROWS_BF16 if dtype == torch.bfloat16 else DEFAULT_MAX_ROWS


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


_BLOCK_SOURCE = Path(__file__).with_name("csrc") / "block_gemm.cpp"
_BLOCK_DTYPES = (torch.float32, torch.bfloat16)  # what the kernel reads and writes


@functools.lru_cache(maxsize=1)
def _block_ext() -> tuple[Any, str | None]:
    ext, err = load_extension("radixserve_block_gemm", _BLOCK_SOURCE)
    if ext is not None and not ext.simd():
        return ext, "this CPU has no AVX512-VNNI, which the block kernel needs"
    return ext, err


def block_kernel_error() -> str | None:
    """None when ``BlockWeight``'s fast kernel runs here, else why ATen's kernels are used."""
    return _block_ext()[1]


class BlockWeight(QuantizedWeight):
    """GGUF-style blocks of 32 (``bits`` 4: Q4_1, 8: Q8_0) run by csrc/block_gemm.cpp.

    ``packed``: uint8 ``[out, in * bits / 8 + in / 8]``, each row its integers (4 bits: byte ``i`` of a
    block holds ``u[i] | u[i+16] << 4``, GGUF's order), then its float16 scales ``d`` and minimums
    ``m`` (``[out, in / 32]`` each; ``qs``, ``d`` and ``m`` are views of those parts)."""

    def __init__(self, w: torch.Tensor, bits: int) -> None:
        ext, err = _block_ext()
        if err is not None:
            raise RuntimeError(f"the block kernel is unavailable: {err}")
        self._ext = ext
        self.bits = bits
        self.method = {4: "int4", 8: "int8"}[bits]
        n, k = w.shape
        if k % INT4_GROUP:
            raise ValueError(f"{self.method} needs the input size ({k}) to be a multiple of {INT4_GROUP}")
        wg = w.detach().float().reshape(n, k // INT4_GROUP, INT4_GROUP)
        if bits == 4:
            lo = wg.amin(dim=-1)
            d = ((wg.amax(dim=-1) - lo) / 15.0).half()
            m = lo.half()
            u = torch.round((wg - m.float()[..., None]) / _nonzero(d)[..., None]).clamp_(0, 15).to(torch.uint8)
            qs = u[..., :16] | (u[..., 16:] << 4)
        else:
            d = (wg.abs().amax(dim=-1) / 127.0).half()
            q = torch.round(wg / _nonzero(d)[..., None]).clamp_(-127, 127)
            qs = (q + 128).to(torch.uint8)
            m = (-128.0 * d.float()).half()  # a power-of-two multiple: exact in float16
        qs = qs.reshape(n, -1)
        self.packed = torch.cat([qs, d.contiguous().view(torch.uint8), m.contiguous().view(torch.uint8)], dim=1)
        qb, nb = qs.shape[1], k // INT4_GROUP
        self.qs = self.packed[:, :qb]
        self.d = self.packed[:, qb : qb + 2 * nb].view(torch.float16)
        self.m = self.packed[:, qb + 2 * nb :].view(torch.float16)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor
        if x.dim() == 2 and x.dtype in _BLOCK_DTYPES and x.stride(-1) == 1:
            # a decode step makes ~120 of these calls: the general path's reshapes and casts cost
            # 4 us each, three times the kernel's own call
            y = self._ext.block_linear(x, self.packed, self.bits)
            return y
        rows = x.reshape(-1, x.shape[-1])
        if rows.dtype not in _BLOCK_DTYPES or rows.stride(-1) != 1:
            rows = rows.float().contiguous()
        y = self._ext.block_linear(rows, self.packed, self.bits)
        return y.to(x.dtype).reshape(*x.shape[:-1], -1)

    def dequantize(self) -> torch.Tensor:
        n = self.qs.shape[0]
        if self.bits == 4:
            b = self.qs.reshape(n, -1, 16)
            u = torch.cat([b & 0x0F, b >> 4], dim=-1).float()
        else:
            u = self.qs.reshape(n, -1, INT4_GROUP).float()
        return (u * self.d.float()[..., None] + self.m.float()[..., None]).reshape(n, -1)

    @property
    def nbytes(self) -> int:
        return self.packed.numel()


def _nonzero(d: torch.Tensor) -> torch.Tensor:
    f = d.float()
    return torch.where(f > 0, f, torch.ones_like(f))


def quantize_weight(w: torch.Tensor, method: str, kernel: str = "auto") -> QuantizedWeight:
    """``method``'s copy of ``w``: ``kernel`` ``"block"`` (csrc/block_gemm.cpp), ``"aten"``, or
    ``"auto"`` (block where it runs fast here, else aten)."""
    if method not in ("int8", "int4"):
        raise ValueError(f"no quantized layout for {method!r}")
    if kernel not in ("auto", "block", "aten"):
        raise ValueError(f"unknown quantization kernel {kernel!r}: auto, block or aten")
    if kernel == "block" or (kernel == "auto" and block_kernel_error() is None):
        return BlockWeight(w, 4 if method == "int4" else 8)
    return Int8Weight(w) if method == "int8" else Int4Weight(w)


if __name__ == "__main__":  # python -m radixserve.model.quant: build the block kernel now (scripts/setup.sh)
    import sys

    from radixserve.model.cpp_build import build_dir

    ext_, err_ = _block_ext()
    if ext_ is None:
        print(f"block quantization kernel: unavailable: {err_}")
        sys.exit(1)
    print(f"block quantization kernel: built in {build_dir()}" + (f" (ATen kernels used: {err_})" if err_ else ""))
