"""How the KV pool stores K and V (``--kv-cache-dtype``).

A format names the element type of the pool's buffers and how a K or V row goes in and comes out:

- ``float32`` / ``bfloat16``: stored as computed (cast to the pool's type).
- ``int8`` and ``fp8_e4m3``: one byte per value and one float32 scale per (token, KV head):
  ``x = scale * q`` with ``scale = max|x| / top`` over the head's ``head_dim`` values (``top``:
  127, rounded to nearest; 448 for e4m3, its 3 mantissa bits). The scale follows each row, so
  nothing saturates, and e4m3 keeps small values out of its subnormals: without a scale most K and
  V values of the bundled model (median |x| ~0.01 next to maxima of 10-20) lost most of their bits,
  and greedy decodes left the bfloat16-KV path several times sooner (scripts/bench_kv_cache_dtype.py).
  The scales cost 4 bytes per ``head_dim`` values: 1.88x the tokens of bfloat16 at ``head_dim`` 64.
- ``fp8_e5m2``: one byte per value and no scale, as SGLang and vLLM store fp8 KV without calibrated
  scales: its exponent spans K and V as they come (beyond 57344 saturates), its 2 mantissa bits are
  what it loses. Exactly half the bytes of bfloat16.

Every reader of the pool dequantizes the same stored bytes the same way (``decode`` here, the
paged kernel's loads in ``csrc/paged_attention.cpp``), so a token attends to the same K and V
whether it is read by prefill, by the torch decode path or by the kernel.

One-byte formats are kept in ``uint8``-compatible buffers and written through ``uint8`` views:
PyTorch's CPU ``index_copy_`` has no float8 kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.config.model import KV_CACHE_DTYPES

_INT8_MAX = 127.0


@dataclass(frozen=True)
class KVFormat:
    name: str
    storage: torch.dtype  # element type of the K/V buffers
    scaled: bool = False  # one float32 scale per (token, KV head) beside the values (int8, fp8_e4m3)
    limit: float = 0.0  # fp8: the largest magnitude stored (scaled: what a row's largest value maps to)

    @staticmethod
    def plain(dtype: torch.dtype) -> KVFormat:
        return KVFormat(str(dtype).removeprefix("torch."), dtype)

    @property
    def top(self) -> float:
        """What a row's largest magnitude maps to (scaled), or where values saturate (fp8 without scales)."""
        return self.limit or _INT8_MAX

    @property
    def quantized(self) -> bool:
        """Whether a row read back differs from the row written (anything narrower than bfloat16)."""
        return self.storage.itemsize == 1

    def row_bytes(self, heads: int, dim: int) -> int:
        """Bytes of one token's K (or V) row of ``heads`` x ``dim``, its scales included."""
        return heads * dim * self.storage.itemsize + (heads * 4 if self.scaled else 0)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x: [T, heads, dim]`` -> (values in ``storage``, ``[T, heads]`` float32 scales or None)."""
        if self.scaled:
            xf = x.float()
            top = self.top
            scales = xf.abs().amax(-1) / top  # [T, heads]
            q = xf / scales.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
            if self.storage == torch.int8:
                return q.round_().to(torch.int8), scales
            return q.clamp_(-top, top).to(self.storage), scales
        if self.limit:
            return x.clamp(-self.limit, self.limit).to(self.storage), None
        return x.to(self.storage), None

    def decode(self, data: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """Stored rows (``[..., heads, dim]``, with ``[..., heads]`` scales if ``scaled``) as ``dtype``."""
        if self.scaled:
            assert scales is not None
            return (data.float() * scales.unsqueeze(-1)).to(dtype)
        return data.to(dtype)


def raw(t: torch.Tensor) -> torch.Tensor:
    """``t`` as bytes when its elements are one byte (what indexed copies of float8 go through)."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t


def kv_format(name: str, model_dtype: torch.dtype) -> KVFormat:
    """The format ``--kv-cache-dtype name`` means for a model computing in ``model_dtype``
    (``auto``: the model's own). Raises ``ValueError`` for an unknown name."""
    if name == "auto":
        return KVFormat.plain(model_dtype)
    if name in ("bf16", "bfloat16"):
        return KVFormat.plain(torch.bfloat16)
    if name == "float32":
        return KVFormat.plain(torch.float32)
    if name in ("fp8", "fp8_e4m3"):
        return KVFormat("fp8_e4m3", torch.float8_e4m3fn, scaled=True, limit=float(torch.finfo(torch.float8_e4m3fn).max))
    if name == "fp8_e5m2":
        return KVFormat(name, torch.float8_e5m2, limit=float(torch.finfo(torch.float8_e5m2).max))
    if name == "int8":
        return KVFormat(name, torch.int8, scaled=True)
    raise ValueError(f"unknown KV cache dtype {name!r}; choose from {', '.join(KV_CACHE_DTYPES)}")
