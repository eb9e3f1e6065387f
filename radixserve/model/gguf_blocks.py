"""GGUF weights kept in their blocks: a quantized matrix is never expanded to float in memory.

A GGUF tensor of torch shape ``[N, K]`` is N rows of ``K / block_size`` blocks, each row whole and
contiguous in the file (K is the fastest dimension). ``GGUFBlocks`` holds such a tensor as a uint8
``[..., N, row_bytes]`` array plus its type, and offers the few operations loading needs, all on
whole rows: llama.cpp's q/k row permutation, fused q/k/v and gate/up cut into their parts, one
expert out of a stacked ``[experts, N, K]`` tensor, parts joined again (``GGUFWeight``), and a
column slice on block boundaries (a tensor-parallel shard of ``o_proj`` / ``down_proj``; one that
would cut blocks is refused, and the loader dequantizes that tensor instead).

``GGUFWeight`` is the linear's side: ``x @ W.T`` by csrc/gguf_dequant.cpp's ``linear``, which
dequantizes one weight row at a time for small inputs (decode: the weights are read once, in their
blocks) and tiles of rows into the BLAS GEMM for large ones (prefill). A bfloat16 model on a CPU
with AVX-512 takes two faster kernels for its decode batches: up to ``VNNI_MAX_ROWS`` rows
(``VNNI_MAX_ROWS_K`` for the K-quants), csrc/gguf_vnni.cpp (activations quantized to ~15 bits per
256 values, integer dot products against the blocks; AVX512-VNNI), and past that the bf16 row kernel
of gguf_dequant.cpp (each weight row expanded to bf16 once, vdpbf16ps dot products; AVX512-BF16).
With AMX, inputs past ``small_rows`` (default 4 there) take gguf_dequant.cpp's AMX kernel (weights
expanded to bf16 tiles in cache, tdpbf16ps) up to about a thousand rows, the tiles and GEMM past it;
and with AMX int8, Q4_0 / Q4_1 / Q8_0 weights packed by ``pack_tiles`` take csrc/gguf_amx8.cpp in
the VNNI kernel's place (integer tiles, each group's sum exact: a decode row costs what it did, a
further row of a verify step about a sixth of what it did).
float32 models keep the float kernel, their exact reference. A fused linear whose parts have
different types (Q4_K_M files keep some ``attn_v`` / ``ffn_down`` in Q6_K) holds one segment per
type and writes each segment's columns of the output.

Which of the two bf16 kernels a row takes changes its numbers (the VNNI kernel quantizes the
activations; each kernel alone computes a row the same way whatever the number of rows). A step
that verifies drafted tokens has more rows than requests; ``decode_rows(n)`` makes its rows take
the kernel a decode step of ``n`` requests takes (the row kernels or the GEMM too), so that verifying
a token computes what decoding it would have.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch

from radixserve.model.dequant import amx8_ext, block_shape, linear_ext, vnni_ext
from radixserve.model.quant import QuantizedWeight

# bfloat16 inputs of up to this many rows take the VNNI integer kernel: whole decode steps of the
# bundled model at 1 / 4 rows took 9.3 / 19.8 ms with it and 15.7 / 23.7 ms with the bf16 kernel
# (AVX-512 EPYC); from 8 rows the bf16 kernel's plain dot products win.
VNNI_MAX_ROWS = 4
# the same for a weight whose every part has integer sub-scales (Q4_K, Q5_K, Q6_K, IQ4_XS: the
# kernel's cheaper scheme): decode steps of a ~1.1B Q4_K_M Llama at 5 / 6 / 8 rows took 85 / 99 /
# 135 ms with it and 113 / 117 / 125 ms with the bf16 kernel
VNNI_MAX_ROWS_K = 6

# the number of requests of the decode step being run, where it has more rows than requests
_decode_requests: ContextVar[int | None] = ContextVar("gguf_decode_requests", default=None)


@contextmanager
def decode_rows(requests: int) -> Iterator[None]:
    """Inside: inputs of up to ``small_rows`` rows pick their bf16 kernel as a decode step of
    ``requests`` rows would (a verify step's rows compute what its requests' decode rows would)."""
    token = _decode_requests.set(requests)
    try:
        yield
    finally:
        _decode_requests.reset(token)


class GGUFBlocks:
    """A GGUF tensor in its blocks: ``data`` uint8 ``[..., rows, row_bytes]``, ``qtype`` its GGML type
    id, ``cols`` the values per row. ``shape`` is the float tensor's shape."""

    __slots__ = ("cols", "data", "qtype")

    def __init__(self, data: torch.Tensor, qtype: int, cols: int) -> None:
        if data.dtype != torch.uint8 or data.dim() < 2:
            raise ValueError("GGUF blocks are uint8 [..., rows, row_bytes]")
        block, size = block_shape(qtype)
        if cols % block or data.shape[-1] != cols // block * size:
            raise ValueError(f"rows of {data.shape[-1]} bytes do not hold {cols} values of GGML type {qtype}")
        self.data, self.qtype, self.cols = data, qtype, cols

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.data.shape[:-1], self.cols))

    def dim(self) -> int:
        return self.data.dim()

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def _rows(self, data: torch.Tensor) -> GGUFBlocks:
        return GGUFBlocks(data, self.qtype, self.cols)

    def __getitem__(self, index: Any) -> GGUFBlocks:
        """Rows (a slice or an integer on the leading dimension); ``[:, a:b]`` columns only where
        ``a`` and ``b`` fall on block boundaries (a tensor-parallel shard of a row-parallel linear),
        else ValueError."""
        if not isinstance(index, tuple):
            return self._rows(self.data[index])
        rows, cols = index
        if not isinstance(cols, slice):
            raise ValueError("GGUF blocks are cut by a slice of columns")
        span = range(self.cols)[cols]
        if span == range(self.cols):
            return self._rows(self.data[rows])
        block, size = block_shape(self.qtype)
        if span.step != 1 or span.start % block or span.stop % block:
            raise ValueError(f"GGUF blocks cannot be cut by columns {span.start}:{span.stop} (GGML type "
                             f"{self.qtype} holds {block} values a block)")
        data = self.data[rows][..., span.start // block * size : span.stop // block * size]
        return GGUFBlocks(data, self.qtype, len(span))

    def split(self, sizes: Sequence[int]) -> tuple[GGUFBlocks, ...]:
        return tuple(self._rows(d) for d in self.data.split(list(sizes)))

    def chunk(self, n: int) -> tuple[GGUFBlocks, ...]:
        return tuple(self._rows(d) for d in self.data.chunk(n))

    def dequantize(self) -> torch.Tensor:
        """The float32 tensor these blocks stand for."""
        return linear_ext().dequantize(self.data.contiguous().reshape(-1), self.qtype).reshape(self.shape)

    def lookup(self, index: torch.Tensor) -> torch.Tensor:
        """float32 rows ``index`` of a 2-D tensor (an embedding lookup)."""
        return linear_ext().rows(self.data, self.qtype, self.cols, index.reshape(-1).to(torch.int64))

    def contiguous(self) -> GGUFBlocks:
        return self if self.data.is_contiguous() else self._rows(self.data.contiguous())


def cat_rows(parts: Sequence[torch.Tensor | GGUFBlocks]) -> torch.Tensor | list[GGUFBlocks]:
    """Parts of a fused weight stacked by rows: a float tensor when any part is float (every part
    dequantized), else the block parts with consecutive parts of one type joined."""
    if not all(isinstance(p, GGUFBlocks) for p in parts):
        return torch.cat([p.dequantize() if isinstance(p, GGUFBlocks) else p.float() for p in parts])
    out: list[GGUFBlocks] = []
    for p in parts:
        assert isinstance(p, GGUFBlocks)
        if out and out[-1].qtype == p.qtype and out[-1].cols == p.cols:
            out[-1] = GGUFBlocks(torch.cat([out[-1].data, p.data]), p.qtype, p.cols)
        else:
            out.append(p.contiguous())
    return out


class GGUFWeight(QuantizedWeight):
    """A linear's ``[out, in]`` weight as GGUF blocks, in one or more row segments; ``__call__``
    serves every input size (no float copy exists). ``small_rows``: inputs up to this many rows
    take the row-at-a-time kernel, larger ones the tiled GEMM."""

    method = "gguf"

    def __init__(self, segments: Sequence[GGUFBlocks], small_rows: int) -> None:
        if not segments or len({s.cols for s in segments}) != 1:
            raise ValueError("a GGUF weight needs segments of one input size")
        self.segments = [s.contiguous() for s in segments]
        self.small_rows = small_rows
        self.in_features = segments[0].cols
        self.out_features = sum(s.data.shape[0] for s in segments)
        self._ext = linear_ext()
        vnni = vnni_ext()
        self._vnni = vnni if vnni is not None and all(vnni.supported(s.qtype) for s in self.segments) else None
        k_quants = self._vnni is not None and all(self._vnni.integer_scaled(s.qtype) for s in self.segments)
        self.vnni_rows = VNNI_MAX_ROWS_K if k_quants else VNNI_MAX_ROWS
        self._tiles: list[torch.Tensor] | None = None  # pack_tiles(): the segments for the AMX int8 kernel
        self._amx8: Any = None
        self._tile_rows = 0  # rows one call of that kernel takes

    def pack_tiles(self) -> bool:
        """Where the CPU has AMX int8 and every segment's type packs (Q4_0, Q4_1, Q8_0): keep the
        segments also laid out for csrc/gguf_amx8.cpp, which then takes the bfloat16 inputs the VNNI
        kernel would (a decode row costs the same, each further row of a speculative verify step about
        a sixth). The blocks stay for the larger inputs (their pages are the file's), so these weights
        are held twice."""
        amx8 = amx8_ext()
        if self._vnni is None or amx8 is None or not all(amx8.supported(s.qtype) for s in self.segments):
            return False
        self._tiles = [amx8.pack(s.data.reshape(-1, s.data.shape[-1]), s.qtype) for s in self.segments]
        self._amx8, self._tile_rows = amx8, int(amx8.max_rows())
        return True

    @property
    def type_ids(self) -> list[int]:
        return [s.qtype for s in self.segments]

    def _segment(self, rows: torch.Tensor, i: int) -> torch.Tensor:
        s = self.segments[i]
        requests = _decode_requests.get()
        n = rows.shape[0] if requests is None else requests
        if n > self.small_rows:
            # tiles (AMX or the GEMM); a verify step's rows keep the AMX kernel its decode rows took,
            # however many drafted rows it has (small_rows -1)
            return self._ext.linear(rows, s.data, s.qtype, 0 if requests is None else -1)
        if self._vnni is not None and rows.dtype == torch.bfloat16 and n <= self.vnni_rows:
            if self._tiles is not None:  # any number of rows, 8 a call: each row's result is its own
                step = self._tile_rows
                parts = [self._amx8.linear(rows[r : r + step], self._tiles[i], s.qtype, s.data.shape[0], s.cols)
                         for r in range(0, rows.shape[0], step)]
                return parts[0] if len(parts) == 1 else torch.cat(parts)
            return self._vnni.linear(rows, s.data, s.qtype)
        return self._ext.linear(rows, s.data, s.qtype, max(self.small_rows, rows.shape[0]))

    @property
    def integer_kernel(self) -> bool:
        """Whether bfloat16 inputs of up to ``min(small_rows, vnni_rows)`` rows run the VNNI integer
        kernel (every segment's type has it and the CPU has AVX512-VNNI)."""
        return self._vnni is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and len(self.segments) == 1:  # a layer's input as the model passes it: no reshapes
            return self._segment(x, 0)
        rows = x.reshape(-1, x.shape[-1])
        if len(self.segments) == 1:
            y = self._segment(rows, 0)
        else:
            y = torch.cat([self._segment(rows, i) for i in range(len(self.segments))], dim=-1)
        return y.reshape(*x.shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([s.dequantize() for s in self.segments])

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.segments) + sum(t.numel() for t in self._tiles or [])

    @property
    def tiles(self) -> list[torch.Tensor]:
        """The segments packed for the AMX int8 kernel (empty unless ``pack_tiles`` packed them)."""
        return list(self._tiles or [])
