"""KV transfer throughput of radixserve.disagg's ZeroMQ backend over local TCP, next to a plain copy
of the same bytes: ``python scripts/bench_kv_transfer.py [tokens] [repeats]``.

A pool shaped like SmolLM2-135M's (30 layers, 3 KV heads x 64, float32) sends ``tokens`` tokens'
K and V from a ``KVSender`` to a ``KVReceiver`` that scatters them into another pool."""

from __future__ import annotations

import sys
import threading
import time

import torch
import zmq

from radixserve.disagg.transfer import KVHeader, KVReceiver, KVSender
from radixserve.mem.kv_pool import KVPool


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    src = KVPool(n, 1, 30, 3, 64, torch.float32)
    dst = KVPool(n, 1, 30, 3, 64, torch.float32)
    for b in src.k_buffers + src.v_buffers:
        b.normal_()
    slots = list(range(1, n + 1))
    ctx = zmq.Context()
    rx, tx = KVReceiver(ctx, "127.0.0.1"), KVSender(ctx)
    nbytes = n * KVPool.bytes_per_token(30, 3, 64, torch.float32)
    best_send = best_copy = float("inf")
    for i in range(reps):
        layers = src.gather(slots)
        done = threading.Event()

        def recv(done: threading.Event = done) -> None:
            while (m := rx.recv()) is None:
                time.sleep(0.0002)
            dst.scatter(slots, [f.buffer for f in m[1]])
            done.set()

        t = threading.Thread(target=recv)
        t.start()
        t0 = time.perf_counter()
        tx.send(rx.endpoint, KVHeader(i, n, 0), layers)
        done.wait()
        best_send = min(best_send, time.perf_counter() - t0)
        t.join()
        assert torch.equal(dst.v_buffers[5][1 : n + 1], src.v_buffers[5][1 : n + 1])
        pairs = [b for kv in zip(dst.k_buffers, dst.v_buffers, strict=True) for b in kv]
        t0 = time.perf_counter()
        for a, b in zip(layers, pairs, strict=True):
            b[1 : n + 1].copy_(a)
        best_copy = min(best_copy, time.perf_counter() - t0)
    print(f"{n} tokens, {nbytes / 1e6:.1f} MB: zmq tcp send+scatter {nbytes / best_send / 1e9:.2f} GB/s, "
          f"plain torch copy {nbytes / best_copy / 1e9:.2f} GB/s (best of {reps})")
    rx.close()
    tx.close()
    ctx.term()


if __name__ == "__main__":
    main()
