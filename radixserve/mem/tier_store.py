"""Where the KV tier keeps its blocks: the block format, and one small class per backend.

A block is the KV of ``block_tokens`` consecutive tokens of one cached prefix, named by a chain
hash (``kv_tier.chain_keys``: the hash of the previous block's name and this block's tokens, the
first block's "previous" being the model's identity and the cache namespace). A stored block is::

    b"RSKVBLK1" | u32 header length | header (msgpack BlockHeader) | payload

and the payload is ``KVPool.gather``'s parts end to end (``K_0, V_0, .., K_{L-1}, V_{L-1}``, each
``[block_tokens, kv_heads, head_dim]`` in the pool's dtype). ``decode_block`` checks everything a
reader can check before the KV reaches the pool: the magic, the model, that the block continues
the expected parent with the expected tokens, the payload's length and its CRC-32. A block that
fails is ``CorruptBlock``: skipped and deleted, never served.

Backends (``TierStore``): ``FileStore`` (a directory, one file per block, written to a temporary
name and renamed, so a kill mid-write leaves a ``.tmp`` that the next start deletes and never a
short block under a real name; it survives restarts) and ``MemoryStore`` (a dict in this process:
the host-memory tier of a GPU server, here a way to study the tier without disk). A remote store
(Mooncake, LMCache, a key-value service) is one more class with these five methods.
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec

logger = logging.getLogger(__name__)

MAGIC = b"RSKVBLK1"
_LEN = struct.Struct("<I")


class BlockHeader(msgspec.Struct):
    model: bytes  # the model identity the KV was computed with
    parent: bytes  # the previous block's key (or the chain's root)
    tokens: list[int]  # the block's token ids
    nbytes: int  # payload bytes
    crc: int  # CRC-32 of the payload


_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder(BlockHeader)


class CorruptBlock(Exception):
    """A stored block that is not what its name promises (truncated, overwritten, another model's)."""


def encode_block(header: BlockHeader) -> bytes:
    """The bytes that go before the payload."""
    h = _ENC.encode(header)
    return MAGIC + _LEN.pack(len(h)) + h


def decode_header(mv: memoryview) -> tuple[BlockHeader, int]:
    """A stored block's header and where its payload starts; ``CorruptBlock`` if unreadable."""
    if bytes(mv[:8]) != MAGIC or len(mv) < 12:
        raise CorruptBlock("not a KV block (bad magic)")
    (hlen,) = _LEN.unpack(mv[8:12])
    try:
        return _DEC.decode(mv[12 : 12 + hlen]), 12 + hlen
    except msgspec.DecodeError as e:
        raise CorruptBlock(f"unreadable header: {e}") from e


def decode_block(data: bytes | memoryview, *, model: bytes, parent: bytes, tokens: Sequence[int]) -> memoryview:
    """The payload of a stored block, after checking it is the block expected; ``CorruptBlock`` if not."""
    mv = memoryview(data)
    h, start = decode_header(mv)
    if h.model != model:
        raise CorruptBlock("computed by another model or KV layout")
    if h.parent != parent or h.tokens != list(tokens):
        raise CorruptBlock("holds other tokens than its name says")
    payload = mv[start:]
    if len(payload) != h.nbytes:
        raise CorruptBlock(f"payload has {len(payload)} bytes, the header says {h.nbytes} (truncated?)")
    if zlib.crc32(payload) != h.crc:
        raise CorruptBlock("payload checksum mismatch")
    return payload


class TierStore(ABC):
    """Blocks by name (a hex string). Methods may raise ``OSError``; the tier logs and carries on."""

    name: str = "?"
    persistent = False

    @abstractmethod
    def put(self, key: str, parts: Sequence[Any]) -> int:
        """Store the concatenation of ``parts`` under ``key``; returns its size in bytes."""

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """The stored bytes of ``key``, None if absent."""

    @abstractmethod
    def delete(self, key: str) -> None: ...

    @abstractmethod
    def scan(self) -> Iterator[tuple[str, int]]:
        """``(key, size)`` of every block already stored (a restart finds them)."""

    def clear(self) -> None:
        for key, _ in list(self.scan()):
            self.delete(key)

    def header(self, key: str) -> BlockHeader | None:
        """A stored block's header alone (None if absent; ``CorruptBlock`` if unreadable)."""
        data = self.get(key)
        return None if data is None else decode_header(memoryview(data))[0]


class MemoryStore(TierStore):
    name = "memory"

    def __init__(self) -> None:
        self._blocks: dict[str, bytes] = {}

    def put(self, key: str, parts: Sequence[Any]) -> int:
        data = b"".join(memoryview(p).cast("B") for p in parts)
        self._blocks[key] = data
        return len(data)

    def get(self, key: str) -> bytes | None:
        return self._blocks.get(key)

    def delete(self, key: str) -> None:
        self._blocks.pop(key, None)

    def scan(self) -> Iterator[tuple[str, int]]:
        return iter([(k, len(v)) for k, v in self._blocks.items()])


class FileStore(TierStore):
    """``<root>/<key[:2]>/<key>.kv``. ``root`` is created if missing; ``OSError`` if it cannot be."""

    name = "file"
    persistent = True

    def __init__(self, root: str) -> None:
        self.root = root
        os.makedirs(root, exist_ok=True)
        probe = os.path.join(root, f".probe.{os.getpid()}")
        with open(probe, "wb") as f:  # fail now, not on the first eviction, if it is not writable
            f.write(b"x")
        os.unlink(probe)

    def _path(self, key: str) -> str:
        return os.path.join(self.root, key[:2], key + ".kv")

    def put(self, key: str, parts: Sequence[Any]) -> int:
        path = self._path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp.{os.getpid()}"
        n = 0
        try:
            with open(tmp, "wb") as f:
                for p in parts:
                    n += f.write(memoryview(p).cast("B"))
            os.replace(tmp, path)  # a reader sees the whole block or none
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        return n

    def get(self, key: str) -> bytes | None:
        try:
            with open(self._path(key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def header(self, key: str) -> BlockHeader | None:
        try:
            with open(self._path(key), "rb") as f:
                head = f.read(12)
                if len(head) < 12:
                    raise CorruptBlock("not a KV block (too short)")
                return decode_header(memoryview(head + f.read(_LEN.unpack(head[8:12])[0])))[0]
        except FileNotFoundError:
            return None

    def delete(self, key: str) -> None:
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass

    def scan(self) -> Iterator[tuple[str, int]]:
        for sub in sorted(os.listdir(self.root)):
            d = os.path.join(self.root, sub)
            if not os.path.isdir(d):
                continue
            for name in os.listdir(d):
                path = os.path.join(d, name)
                if ".tmp." in name:  # a write cut short by a kill: never renamed, never served
                    logger.info("KV tier: removing the unfinished write %s", path)
                    os.unlink(path)
                elif name.endswith(".kv"):
                    yield name[:-3], os.path.getsize(path)
