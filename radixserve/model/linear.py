"""The model's linear layer: a weight with the fastest CPU GEMM path this machine has.

``Linear`` runs plain ``F.linear`` (MKL) for unpacked float32, oneDNN's pre-packed weights where
they pay (``pack``), a weight-only quantized copy for small inputs (``quantize``, quant.py), or a
GGUF file's blocks for every input instead of any float weight (``load``, gguf_blocks.py).
oneDNN inputs are padded to a few row counts (``gemm_rows``) so that its per-shape primitives stay
cached instead of piling up with every new prompt length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.model.gguf_blocks import GGUFBlocks, GGUFWeight, cat_rows
from radixserve.model.quant import DEFAULT_BLOCK_ROWS, DEFAULT_MAX_ROWS, QuantizedWeight, quantize_weight


def empty_param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """``y = x @ W.T (+ b)`` with ``W: [out, in]`` contiguous, as ``F.linear`` (MKL sgemm) wants it.

    ``pack()`` switches to oneDNN's pre-packed weight layout when the build has it (float32, and
    bfloat16 where the CPU has native bf16: ~1.2-4x faster, most for the LM head and for small
    batches); ``F.linear`` otherwise.
    Inputs to oneDNN (packed, or not float32) are padded to ``gemm_rows`` rows.

    ``quantize()`` adds a weight-only quantized copy (quant.py) that inputs of at most
    ``quant_max_rows`` rows use (decode at small batches, bound by reading the weights); larger
    inputs keep the float path, where the GEMM is compute-bound and oneDNN is faster.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = empty_param(out_features, in_features, dtype=dtype)
        self.bias = empty_param(out_features, dtype=dtype) if bias else None
        self._packed: torch.Tensor | None = None
        self._quant: QuantizedWeight | None = None
        self.quant_max_rows = 0

    def load(self, parts: list[torch.Tensor | GGUFBlocks], small_rows: int = DEFAULT_BLOCK_ROWS) -> None:
        """Set the weight from its row parts (fused q/k/v, gate/up): float parts are copied in; if
        every part is GGUF blocks, the linear keeps them and holds no float weight at all."""
        w = cat_rows(parts)
        if isinstance(w, torch.Tensor):
            self.weight.copy_(w)
            return
        self._quant = GGUFWeight(w, small_rows)
        if (self._quant.out_features, self._quant.in_features) != (self.out_features, self.in_features):
            raise ValueError(f"GGUF weight of {self._quant.out_features}x{self._quant.in_features}, the linear "
                             f"is {self.out_features}x{self.in_features}")
        self.quant_max_rows = 1 << 62  # every input
        self.weight = empty_param(0, dtype=self.weight.dtype)

    @property
    def in_blocks(self) -> bool:
        """Whether the weight is only GGUF blocks (no float copy)."""
        return isinstance(self._quant, GGUFWeight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._quant is not None and x.shape[0] <= self.quant_max_rows:
            y = self._quant(x)
            return y if self.bias is None else y + self.bias
        if self._packed is None and x.dtype == torch.float32:
            return F.linear(x, self.weight, self.bias)  # MKL sgemm: no per-shape state
        m = x.shape[0]
        rows = gemm_rows(m)
        if rows != m:
            x = F.pad(x, (0, 0, 0, rows - m))
        if self._packed is not None:
            y = torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        else:
            y = F.linear(x, self.weight, self.bias)
        return y if rows == m else y[:m]

    def pack(self, batch_hint: int = 64) -> bool:
        """Pre-pack the weight for oneDNN; returns whether it did (and checked the result)."""
        if self.in_blocks or not _mkldnn_linear_available(self.weight.dtype):
            return False
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), batch_hint)
            x = torch.randn(3, self.in_features, dtype=self.weight.dtype)
            want = F.linear(x.float(), self.weight.float(), None if self.bias is None else self.bias.float())
            got = torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "").float()
            # float32 must agree to rounding; bfloat16 to its 8-bit mantissa (and its rounded output)
            tol = 1e-4 if self.weight.dtype == torch.float32 else 2e-2
            if not torch.allclose(got, want, rtol=tol, atol=tol * float(want.abs().max()) + 1e-6):
                return False
        except (RuntimeError, AttributeError):
            return False
        self._packed = packed
        return True

    def quantize(self, method: str, max_rows: int = DEFAULT_MAX_ROWS, kernel: str = "auto") -> None:
        """Keep a ``method`` copy of the weight (quant.py; ``kernel``: see ``quantize_weight``) for
        inputs of at most ``max_rows`` rows."""
        w = self.weight if self.weight.numel() else None
        if w is None:
            raise RuntimeError("quantize() before drop_plain_weight(): the float weight is gone")
        self._quant = quantize_weight(w, method, kernel)
        self.quant_max_rows = max_rows

    @property
    def quantization(self) -> str:
        return self._quant.method if self._quant is not None else "none"

    def drop_plain_weight(self) -> None:
        """Free the ``[out, in]`` weight once packed (the packed copy is all forward uses)."""
        if self._packed is not None:
            self.weight = empty_param(0, dtype=self.weight.dtype)

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, "
            f"packed={self._packed is not None}, quantization={self.quantization}"
        )


def gemm_rows(m: int) -> int:
    """The row count a oneDNN GEMM of ``m`` rows runs with: ``m`` up to 16, else ``m`` rounded up
    to the next of 8 steps per power of two (at most 12.5% padding rows).

    oneDNN (the packed float32 path, and every bfloat16 ``F.linear``) builds and caches a primitive
    per input shape. Every prefill length and batch size being a new shape, its 1,024-entry cache
    churned: each new primitive costs its creation time, and the buffers freed on eviction stayed
    in glibc's arenas, so a serving process grew by hundreds of MiB per thousand requests. Rounded,
    a 16k-token range needs under a hundred shapes per layer, which stay cached.
    """
    if m <= 16:
        return m
    step = 1 << (m.bit_length() - 4)
    return -(-m // step) * step


_MKLDNN_OK: bool | None = None
_MKLDNN_BF16_OK: bool | None = None


def _mkldnn_linear_available(dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed linear serves ``dtype``: float32 wherever the op exists, bfloat16
    where the CPU has native bf16 dot products (AVX512-BF16 or AMX): there the packed weights are
    1.2-4x faster than ``F.linear``, which reorders its weight for oneDNN on every call (most for
    the LM head at batch 1)."""
    global _MKLDNN_OK, _MKLDNN_BF16_OK
    if _MKLDNN_OK is None:
        _MKLDNN_OK = bool(
            torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        )
    if dtype == torch.float32:
        return _MKLDNN_OK
    if dtype != torch.bfloat16 or not _MKLDNN_OK:
        return False
    if _MKLDNN_BF16_OK is None:
        try:
            _MKLDNN_BF16_OK = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (RuntimeError, AttributeError):
            _MKLDNN_BF16_OK = False
    return _MKLDNN_BF16_OK
