"""Reading a GGUF file's header: metadata key/values and tensor infos, in one pass.

Layout (little-endian, versions 2 and 3): ``b"GGUF"``, version u32, tensor count u64, key/value
count u64; then each key/value (a string key, a value type u32, the value); then each tensor info
(name, dims u32 + that many u64 in ``ne`` order, ggml type u32, offset u64); the tensor data starts
at the next multiple of ``general.alignment`` (32 by default). A string is a u64 length and UTF-8
bytes; an array is an element type u32, a count u64 and the elements.

``gguf.GGUFReader`` builds a numpy view for every part of every metadata entry: about a million of
them for a 49k-token vocabulary with its merges, which is most of a server's start-up on a slow
machine. Here strings are decoded straight from the mapped bytes and numeric arrays are read with
one ``frombuffer`` each. Tensors are numpy views of the mapped file in the shapes
``gguf.quants.dequantize`` takes (the ``gguf`` package still supplies the type table and the
dequantization). This module imports numpy and ``gguf.constants`` only: the processes that read a
model's tokenizer and config never import torch.
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
from typing import Any, NamedTuple, NoReturn

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
_VERSIONS = (2, 3)
# Value types: 0-7, 10-12 are fixed-size scalars (struct format), 8 is a string, 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# A string longer than this is a corrupt length, not a value: refuse it before slicing.
_MAX_STRING = 1 << 30
# Plain numpy element types; every other ggml type is bytes in its blocks.
_PLAIN = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class GGUFTensor(NamedTuple):
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # ``ne`` order: the fastest-moving dimension first (torch's shape reversed)
    data: np.ndarray  # plain types: elements, torch's shape; block types: uint8 rows of blocks


_U64 = struct.Struct("<Q")


class GGUFFile:
    """The header of a GGUF file and views of its tensors (the file stays mapped while they live)."""

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                self._refuse("the file is empty")
            self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._mv = memoryview(self._buf)
        self._pos = 0
        if bytes(self._take(4)) != _MAGIC:
            self._refuse("no GGUF magic at the start")
        self.version = self._scalar("I")
        if self.version not in _VERSIONS:
            if self.version & 0xFFFF == 0:
                self._refuse("a big-endian file (only little-endian GGUF is read)")
            self._refuse(f"GGUF version {self.version} (versions {', '.join(map(str, _VERSIONS))} are read)")
        n_tensors = self._scalar("Q")
        n_kv = self._scalar("Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._scalar("I"))
        infos = [self._tensor_info() for _ in range(n_tensors)]
        alignment = self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            self._refuse(f"general.alignment {alignment!r} is not a power of two")
        start = -(-self._pos // alignment) * alignment
        self.tensors = [self._tensor(start, *info) for info in infos]

    def release_pages(self) -> None:
        """Drop the file's pages from this process's mapping; they stay in the page cache. The parts
        the loader copied (fused q/k/v and gate/up, permuted q/k) are never read again, and would
        otherwise count in the resident memory twice, as mapped file pages and as the copies;
        tensors read in place map their pages back on first use."""
        if hasattr(mmap, "MADV_DONTNEED"):
            self._buf.madvise(mmap.MADV_DONTNEED)

    # ------------------------------------------------------------------ reading
    def _refuse(self, why: str) -> NoReturn:
        raise ValueError(f"{self.path} is not a readable GGUF file: {why}")

    def _take(self, n: int) -> memoryview:
        end = self._pos + n
        if end > len(self._mv):
            self._refuse(f"it ends inside its header (wanted {n} bytes at offset {self._pos})")
        out = self._mv[self._pos : end]
        self._pos = end
        return out

    def _scalar(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        return struct.unpack_from("<" + fmt, self._take(size))[0]

    def _string(self) -> str:
        n = self._scalar("Q")
        if n > _MAX_STRING:
            self._refuse(f"a string of {n} bytes at offset {self._pos - 8}")
        try:
            return str(self._take(n), "utf-8")
        except UnicodeDecodeError as e:
            self._refuse(f"a string that is not UTF-8 at offset {self._pos - n}: {e.reason}")

    def _strings(self, count: int) -> list[str]:
        """``count`` strings in a row (a vocabulary, a merge list: ~50k each) in one tight loop, with
        ``_string``'s checks: half the time of reading them one by one."""
        mv, pos, size = self._mv, self._pos, len(self._mv)
        length = _U64.unpack_from
        out: list[str] = []
        append = out.append
        for _ in range(count):
            if pos + 8 > size:
                self._pos = pos
                self._take(8)  # refuses: the file ends here
            (n,) = length(mv, pos)
            pos += 8
            if n > _MAX_STRING:
                self._refuse(f"a string of {n} bytes at offset {pos - 8}")
            if pos + n > size:
                self._pos = pos
                self._take(n)  # refuses
            try:
                append(str(mv[pos : pos + n], "utf-8"))
            except UnicodeDecodeError as e:
                self._refuse(f"a string that is not UTF-8 at offset {pos}: {e.reason}")
            pos += n
        self._pos = pos
        return out

    def _value(self, vtype: int) -> Any:
        fmt = _SCALARS.get(vtype)
        if fmt is not None:
            return self._scalar(fmt)
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            etype = self._scalar("I")
            count = self._scalar("Q")
            fmt = _SCALARS.get(etype)
            if fmt is not None:  # numeric: one read for the whole array
                dtype = np.dtype("<" + fmt) if fmt != "?" else np.dtype(np.bool_)
                raw = self._take(count * dtype.itemsize)
                return np.frombuffer(raw, dtype=dtype).tolist()
            if etype == _STRING:
                return self._strings(count)
            return [self._value(etype) for _ in range(count)]
        self._refuse(f"unknown value type {vtype} at offset {self._pos - 4}")

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        n_dims = self._scalar("I")
        if n_dims > 8:
            self._refuse(f"tensor {name!r} has {n_dims} dimensions")
        dims = tuple(self._scalar("Q") for _ in range(n_dims))
        return name, dims, self._scalar("I"), self._scalar("Q")

    def _tensor(self, start: int, name: str, dims: tuple[int, ...], raw_type: int, offset: int) -> GGUFTensor:
        try:
            ttype = GGMLQuantizationType(raw_type)
        except ValueError:
            self._refuse(f"tensor {name!r} has unknown ggml type {raw_type}")
        block, type_size = GGML_QUANT_SIZES[ttype]
        n_elems = int(np.prod(dims, dtype=np.int64)) if dims else 1
        torch_shape = tuple(reversed(dims))
        if n_elems % block or (torch_shape and torch_shape[-1] % block):
            self._refuse(f"tensor {name!r} of shape {dims} is not whole {ttype.name} blocks of {block}")
        n_bytes = n_elems // block * type_size
        begin = start + offset
        if begin + n_bytes > len(self._buf):
            self._refuse(f"tensor {name!r} ends at byte {begin + n_bytes}, past the end of the file ({len(self._buf)})")
        plain = _PLAIN.get(ttype)
        if plain is not None:
            data = np.frombuffer(self._buf, dtype=plain, count=n_elems, offset=begin).reshape(torch_shape)
        else:
            row_bytes = torch_shape[-1] // block * type_size
            data = np.frombuffer(self._buf, dtype=np.uint8, count=n_bytes, offset=begin)
            data = data.reshape(*torch_shape[:-1], row_bytes)
        return GGUFTensor(name, ttype, dims, data)


@functools.lru_cache(maxsize=2)
def _open(path: str, mtime_ns: int) -> GGUFFile:
    return GGUFFile(path)


def open_gguf(path: str) -> GGUFFile:
    """The parsed header of a GGUF file, shared by the loader and the tokenizer in one process."""
    try:
        return _open(os.path.abspath(path), os.stat(path).st_mtime_ns)
    except OSError as e:
        raise ValueError(f"{path} is not a readable GGUF file: {e.strerror or e}") from e


def clear_gguf_cache() -> None:
    _open.cache_clear()


def read_gguf_metadata(path: str) -> dict[str, Any]:
    """All metadata key/values of a GGUF file as python values (do not mutate: it is cached)."""
    return open_gguf(path).metadata
