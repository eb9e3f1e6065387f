"""The router following a worker's cache through KV events in vLLM's published schema
(``--cache-events-format vllm``): what a radixserve worker started with ``--kv-events-config``
publishes, and what vLLM and SGLang workers publish.

The messages are ``[topic, seq, payload]``: ``seq`` 8 bytes big-endian, ``payload`` a msgpack
``KVEventBatch`` (``mem/vllm_events.py``). vLLM's events name blocks by hash; only ``BlockStored``
carries tokens. ``BlockPaths`` keeps, per announced block, its parent's hash and its tokens, so an
event turns into the token paths the prefix tree is keyed by (``mem.cache_events``):

- ``BlockStored(hashes, parent, tokens)`` -> ``BlockStored(path of parent + tokens, start=len(path
  of parent))``; a parent never announced (stored before this subscriber connected, or lost) makes
  the event, and the blocks under it, unplaceable: they are skipped;
- ``BlockRemoved(hashes)`` -> per block known, ``BlockRemoved(its path, keep=the path before it)``;
- ``AllBlocksCleared`` -> ``AllCleared``.

The gap rule is ``cache_events.py``'s (a break in ``seq`` forgets the worker's tree state), and it
forgets the block map too.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import msgspec
import zmq

from radixserve.mem.cache_events import AllCleared, BlockRemoved, BlockStored, CacheEvent, EventBatch
from radixserve.mem.vllm_events import KVEventBatch, VLLMAllBlocksCleared, VLLMBlockRemoved, VLLMBlockStored
from radixserve.router.cache_events import CacheEventSubscriber, apply_batch

logger = logging.getLogger("radixserve.router")

_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def _tier(medium: str | None) -> str | None:
    """vLLM's medium as ours: the device pool ("GPU", or unset) is None, any other a lower tier."""
    return None if medium is None or medium.upper() == "GPU" else medium


class BlockPaths:
    def __init__(self) -> None:
        self.blocks: dict[int, tuple[int | None, Sequence[int]]] = {}  # hash -> (parent hash, its tokens)

    def path(self, block: int | None) -> list[int] | None:
        """The tokens from the root to the end of ``block`` (None: not known); [] for no block."""
        parts: list[Sequence[int]] = []
        while block is not None:
            got = self.blocks.get(block)
            if got is None:
                return None
            block, tokens = got[0], got[1]
            parts.append(tokens)
        return [t for part in reversed(parts) for t in part]

    def convert(self, events: Sequence[object]) -> list[CacheEvent]:
        out: list[CacheEvent] = []
        for ev in events:
            if isinstance(ev, VLLMBlockStored):
                prefix = self.path(ev.parent_block_hash)
                size = ev.block_size
                if prefix is None or size <= 0 or len(ev.token_ids) != size * len(ev.block_hashes):
                    continue  # placed under a block this side never saw
                parent = ev.parent_block_hash
                for i, h in enumerate(ev.block_hashes):
                    self.blocks[h] = (parent, ev.token_ids[i * size : (i + 1) * size])
                    parent = h
                out.append(BlockStored(prefix + list(ev.token_ids), start=len(prefix), medium=_tier(ev.medium)))
            elif isinstance(ev, VLLMBlockRemoved):
                paths = [(h, self.path(h)) for h in ev.block_hashes]  # all before any is forgotten
                for h, path in paths:
                    if path is not None:
                        out.append(BlockRemoved(path, keep=len(path) - len(self.blocks[h][1]), medium=_tier(ev.medium)))
                for h, _ in paths:
                    self.blocks.pop(h, None)
            elif isinstance(ev, VLLMAllBlocksCleared):
                self.blocks.clear()
                out.append(AllCleared())
        return out


class VLLMEventSubscriber(CacheEventSubscriber):
    """``CacheEventSubscriber`` for vLLM-schema publishers (multipart messages, blocks by hash)."""

    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.paths = BlockPaths()

    async def receive(self, sock: zmq.asyncio.Socket) -> object:
        return await sock.recv_multipart()

    def on_message(self, raw: object) -> None:
        try:
            frames = list(raw)  # type: ignore[call-overload]
            seq = int.from_bytes(frames[-2], "big", signed=True)
            kv = _DECODER.decode(frames[-1])
        except (msgspec.DecodeError, TypeError, IndexError) as e:
            self.errors += 1
            logger.warning("KV events of %s: undecodable message (%s)", self.target_key, e)
            return
        last = self.last_seq
        if last is not None and seq != last + 1:
            self.gaps += 1
            self.paths.blocks.clear()
        batch = EventBatch(seq, kv.ts, [])
        try:
            batch.events = self.paths.convert(kv.events)
            apply_batch(self.policy, self.target_key, batch, last)
        except Exception:  # a bug here must not end the subscription, nor leave half a batch applied
            logger.exception("KV events of %s: applying batch %d failed; forgetting its prefixes",
                             self.target_key, seq)
            self.policy.remove_target(self.target_key)
            self.paths.blocks.clear()
        self.last_seq, self.last_ts = seq, kv.ts
        self.batches += 1
        self.events += len(kv.events)
