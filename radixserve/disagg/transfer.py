"""The wire: typed control messages (msgpack, nothing pickled) and KV pages as raw frames.

    decode DEALER ──Register(room, endpoint)──> prefill ROUTER (the bootstrap server)
    prefill PUSH  ──[KVHeader, K_0, V_0, ..., K_{L-1}, V_{L-1}]──> decode PULL (its endpoint)
    decode DEALER ──Ack(room, ok)──> prefill ROUTER

Each K/V frame is one layer's rows for the transferred tokens, ``[n, kv_heads, head_dim]`` as the
pool stores them (``KVPool.gather``: an int8 pool's scales follow each layer's V), sent zero-copy from the gathered tensor and written straight into
the reserved slots on arrival (``KVPool.scatter``). ``KVSender`` / ``KVReceiver`` are the seam where an RDMA backend would go: a pair of
classes with the same methods, named in ``TRANSFER_BACKENDS``.
"""

from __future__ import annotations

import msgspec
import torch
import zmq


class Register(msgspec.Struct, tag=True):
    room: int
    endpoint: str  # the decode worker's KV receive endpoint (tcp://host:port)


class Ack(msgspec.Struct, tag=True):
    room: int
    ok: bool
    error: str = ""


class KVHeader(msgspec.Struct, tag=True):
    room: int
    num_tokens: int  # tokens whose KV follows (the prompt's page-aligned cached part)
    first_token: int  # the token the prefill worker sampled
    logprob: float | None = None
    error: str = ""  # the prefill side failed this room: no frames follow
    kv_format: str = ""  # the sender's KV format (--kv-cache-dtype as resolved); the receiver's must match


ControlMsg = Register | Ack
ENC = msgspec.msgpack.Encoder()
CONTROL_DEC = msgspec.msgpack.Decoder(ControlMsg)
HEADER_DEC = msgspec.msgpack.Decoder(KVHeader)


class KVSender:
    """Prefill side: one PUSH socket per decode endpoint, connected on first use."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.ctx = ctx
        self.socks: dict[str, zmq.Socket] = {}

    def _sock(self, endpoint: str) -> zmq.Socket:
        s = self.socks.get(endpoint)
        if s is None:
            s = self.ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 64)
            s.connect(endpoint)
            self.socks[endpoint] = s
        return s

    def send(self, endpoint: str, header: KVHeader, layers: list[torch.Tensor]) -> int:
        """Queue the header and the layers' frames (zero-copy); returns the payload bytes."""
        frames: list[bytes | memoryview] = [ENC.encode(header)]
        frames += [t.view(torch.uint8).numpy().data for t in layers]
        self._sock(endpoint).send_multipart(frames, copy=False)
        return sum(t.numel() * t.element_size() for t in layers)

    def close(self) -> None:
        for s in self.socks.values():
            s.close(0)
        self.socks.clear()


class KVReceiver:
    """Decode side: a PULL socket on an ephemeral port of ``host``, and the DEALER sockets that
    talk to each prefill worker's bootstrap server."""

    def __init__(self, ctx: zmq.Context, host: str) -> None:
        self.ctx = ctx
        self.pull = ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        port = self.pull.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self.dealers: dict[str, zmq.Socket] = {}

    def dealer(self, bootstrap: str) -> zmq.Socket:
        s = self.dealers.get(bootstrap)
        if s is None:
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(bootstrap)
            self.dealers[bootstrap] = s
        return s

    def register(self, bootstrap: str, room: int) -> None:
        self.dealer(bootstrap).send(ENC.encode(Register(room, self.endpoint)), zmq.NOBLOCK)

    def ack(self, bootstrap: str, room: int, ok: bool, error: str = "") -> None:
        try:
            self.dealer(bootstrap).send(ENC.encode(Ack(room, ok, error)), zmq.NOBLOCK)
        except zmq.Again:  # the prefill worker is gone; its side times out
            pass

    def recv(self) -> tuple[KVHeader, list[zmq.Frame]] | None:
        try:
            parts = self.pull.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        return HEADER_DEC.decode(parts[0].bytes), list(parts[1:])

    def close(self) -> None:
        self.pull.close(0)
        for s in self.dealers.values():
            s.close(0)
        self.dealers.clear()


# ``--disaggregation-transfer-backend``: the sender and receiver each backend name stands for
TRANSFER_BACKENDS: dict[str, tuple[type[KVSender], type[KVReceiver]]] = {"zmq": (KVSender, KVReceiver)}
