"""A prefill worker's KV reaching a decode worker over ZeroMQ, in process: an int8 pool's values and
scales arrive bit for bit, and a decode worker whose ``--kv-cache-dtype`` differs refuses the
transfer (the request fails with the reason) instead of reading bytes of another format."""

from __future__ import annotations

import time

import pytest
import torch
import zmq

from radixserve.config import ServerArgs
from radixserve.disagg.decode import DecodeRooms, RoomFailure
from radixserve.disagg.prefill import PrefillRooms
from radixserve.mem.kv_format import kv_format
from radixserve.mem.kv_pool import KVPool
from radixserve.sched.build import build_kv
from radixserve.sched.kv_manager import KVManager
from radixserve.sched.req import Req, SamplingParams

PROMPT = list(range(100, 140))


def _side(fmt: str) -> tuple[KVManager, KVPool]:
    kv = build_kv(ServerArgs(page_size=4), 256, 128, max_reqs=4)
    return kv, KVPool(256, 4, 2, 3, 64, kv_format(fmt, torch.float32))


def _prefilled(kv: KVManager, pool: KVPool) -> list[int]:
    """Compute PROMPT on the prefill side: random K/V in its slots, cached in its radix tree."""
    r = Req("p", PROMPT, SamplingParams(max_new_tokens=1))
    kv.match(r)
    kv.lock_match(r)
    kv.admit(r)
    kv.grow(r, r.extend_input_len)
    slots = kv.req_to_token_pool.req_to_token[r.req_pool_idx, : len(PROMPT)]
    g = torch.Generator().manual_seed(0)
    for layer in range(2):
        pool.write(layer, slots, torch.randn(len(PROMPT), 3, 64, generator=g), torch.randn(len(PROMPT), 3, 64, generator=g))
    kv.release(r)
    return kv.cached_slots(PROMPT)


@pytest.mark.parametrize(("sent", "wanted"), [("int8", "int8"), ("fp8_e4m3", "fp8_e4m3"), ("fp8_e4m3", "int8"),
                                              ("bf16", "fp8_e5m2")])
def test_transfer_carries_the_format_or_is_refused(sent: str, wanted: str) -> None:
    ctx = zmq.Context()
    try:
        pkv, ppool = _side(sent)
        dkv, dpool = _side(wanted)
        src = _prefilled(pkv, ppool)
        pre = PrefillRooms(ctx, "tcp://127.0.0.1:0", pkv, ppool, timeout_s=30)
        bootstrap = pre.router.getsockopt(zmq.LAST_ENDPOINT).decode()
        dec = DecodeRooms(ctx, "127.0.0.1", dkv, dpool, headroom=8, timeout_s=30)
        dec.open(7, bootstrap, PROMPT, payload="req")
        pre.on_prefilled(7, PROMPT, first_token=5, logprob=None)
        arrived = []
        deadline = time.monotonic() + 20
        while not arrived and time.monotonic() < deadline:
            pre.poll()
            arrived = dec.poll()
            time.sleep(0.01)
        assert len(arrived) == 1
        if sent == wanted:
            assert not arrived[0].error
            dst = dkv.cached_slots(PROMPT)
            assert len(dst) == len(src) == len(PROMPT)
            for a, b in zip(ppool.gather(src), dpool.gather(dst), strict=True):
                assert torch.equal(a, b)
            dkv.unlock(arrived[0].hold)
            dkv.check_invariant()
        else:
            assert arrived[0].failure == RoomFailure.BAD_TRANSFER
            assert f"the prefill worker's KV is {kv_format(sent, torch.float32).name}" in (arrived[0].error or "")
            assert "--kv-cache-dtype must match" in (arrived[0].error or "")
            dkv.check_invariant()
    finally:
        ctx.destroy(linger=0)
