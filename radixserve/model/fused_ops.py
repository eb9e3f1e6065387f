"""The small per-layer ops of the forward (RMSNorm + residual add, RoPE, SiLU x up), two ways.

``TorchOps`` is the reference: plain torch calls, several per op, each reading and writing the
whole activation. ``CppOps`` does each op in one pass over its rows (``csrc/fused_ops.cpp``,
AVX-512 where the CPU has it, float32 math) and rounds where the reference rounds, so its results
match the reference's: exactly for the residual add and RoPE, up to the order of a sum for the
norms, and within one bfloat16 rounding step for SiLU x up (its own exp). The tests
(tests/model/test_fused_ops.py) state the tolerances.

The model picks them with its attention backend: a backend whose ``fused_small_ops`` is true
(``cpu_paged``: the build that has a compiler) gets ``CppOps``, the others ``TorchOps``;
``LlamaForCausalLM.set_small_ops`` switches them on a built model (benches, tests). If the
extension cannot be built, ``cpu_paged`` falls back to ``TorchOps`` with a warning.

Both share one signature set. ``add_rms_norm`` updates ``residual`` in place (the running hidden
state of the layer stack) and returns the normalised copy the next GEMM reads; ``rope`` may rotate
``qk`` in place and returns the rotated tensor.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from radixserve.model.cpp_build import load_extension

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "fused_ops.cpp"
# float32 results equal to the reference's: no a*b+c contracted into one rounding
_CFLAGS = ["-ffp-contract=off"]


@functools.lru_cache(maxsize=1)
def _load() -> tuple[Any, str | None]:
    return load_extension("radixserve_fused_ops", _SOURCE, _CFLAGS)


def extension_error() -> str | None:
    """None when the extension builds, else the reason it does not."""
    return _load()[1]


# ------------------------------------------------------------------------------------------------
# The reference (what llama.py computed inline before; HF's formulas)
# ------------------------------------------------------------------------------------------------
def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm: normalize in float32, cast back, then scale."""
    if x.dtype == torch.float32:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF ``x * cos + rotate_half(x) * sin`` for ``x: [T, heads, D]``, ``cos/sin: [T, D/2]`` (HF's
    halves are equal): same floating-point result, half the elementwise work."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    n = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :n]) * gate_up[..., n:]


class TorchOps:
    name = "torch"
    fused = False  # the model runs its layers as HF writes them (llama.py DecoderLayer.forward)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm_torch(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        residual.add_(x)
        return rms_norm_torch(residual, weight, eps)

    def rope(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return rope_torch(qk, cos, sin)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_mul_torch(gate_up)


class CppOps(TorchOps):
    """The C++ kernels; shapes they do not take (3-d norms, a non-contiguous last dimension) go to
    the reference."""

    name = "cpp"
    fused = True  # the model folds each residual add into the next norm (DecoderLayer.forward_fused)

    def __init__(self) -> None:
        ext, err = _load()
        if ext is None:
            raise RuntimeError(f"the fused small ops' C++ extension could not be built ({err})")
        self._ext = ext

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() != 2 or x.stride(-1) != 1:
            return rms_norm_torch(x, weight, eps)
        out: torch.Tensor = self._ext.rms_norm(x, weight, eps)
        return out

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() != 2 or x.stride(-1) != 1 or residual.stride(-1) != 1:
            return super().add_rms_norm(x, residual, weight, eps)
        out: torch.Tensor = self._ext.add_rms_norm(x, residual, weight, eps)
        return out

    def rope(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if qk.stride(-1) != 1:
            return rope_torch(qk, cos, sin)
        self._ext.rope_(qk, cos, sin)
        return qk

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dim() != 2 or gate_up.stride(-1) != 1:
            return silu_mul_torch(gate_up)
        out: torch.Tensor = self._ext.silu_mul(gate_up)
        return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of float32 ``[B, V]`` rows, the same indices (first maximum, first NaN):
    the extension's loop where it builds, else torch's (which costs ~0.1 ms a row over a 49k vocabulary)."""
    ext = _load()[0]
    if ext is None or x.dim() != 2 or x.dtype != torch.float32 or x.shape[1] == 0:
        return x.argmax(dim=-1)
    out: torch.Tensor = ext.argmax_rows(x)
    return out


def make_small_ops(name: str) -> TorchOps:
    """``"torch"``, ``"cpp"`` (raises ``RuntimeError`` saying why if it cannot be built), or
    ``"auto"``: cpp where it builds, else torch with a warning."""
    if name == "torch":
        return TorchOps()
    if name == "cpp":
        return CppOps()
    if name == "auto":
        err = extension_error()
        if err is None:
            return CppOps()
        logger.warning("fused small ops unavailable (%s); using the torch ops", err)
        return TorchOps()
    raise ValueError(f"unknown small ops {name!r}: torch, cpp or auto")


if __name__ == "__main__":  # python -m radixserve.model.fused_ops: build it now (scripts/setup.sh)
    import sys

    from radixserve.model.cpp_build import build_dir

    err = extension_error()
    print(f"fused small ops extension: {'built in ' + str(build_dir()) if err is None else 'unavailable: ' + err}")
    sys.exit(0 if err is None else 1)
