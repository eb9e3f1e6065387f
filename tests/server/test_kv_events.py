"""``--kv-events-config``: the config as vLLM and SGLang write it, and the publisher on real ZeroMQ
sockets: numbered batches on a PUB socket, the missed ones replayed from the ROUTER socket."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from radixserve.config import ServerArgs
from radixserve.config.kv_events import KVEventsConfig
from radixserve.mem.cache_events import AllCleared, BlockStored
from radixserve.server.kv_events import END_SEQ, VLLMEventPublisher, rank_endpoint
from tests.mem.test_vllm_events import DECODER, AllBlocksCleared
from tests.mem.test_vllm_events import BlockStored as VLLMStored
from tests.router.router_helpers import router_in_thread
from tests.server.helpers import ServerProcess


def test_config_as_vllm_and_sglang_write_it() -> None:
    vllm = KVEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "zmq", '
                                '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv"}')
    assert vllm.enabled and vllm.replay_endpoint == "tcp://*:5558" and vllm.topic == "kv"
    assert not KVEventsConfig.parse('{"enable_kv_cache_events": false}').enabled
    assert not KVEventsConfig.parse('{"publisher": "null"}').enabled
    assert KVEventsConfig.parse('{"publisher": "zmq", "bind": true, "format": "default"}').bind is True  # SGLang's
    for bad, says in (('{"publisher": "kafka"}', "publisher must be"), ('{"format": "dynamo"}', "format must be"),
                      ('{"endpoint": "x", "nope": 1}', "unknown key"), ("[1]", "JSON object"), ("{", "not JSON"),
                      ('{"buffer_steps": -1}', "buffer_steps")):
        with pytest.raises(ValueError, match=says):
            KVEventsConfig.parse(bad)
        with pytest.raises(ValueError, match=says):
            ServerArgs(kv_events_config=bad)
    with pytest.raises(ValueError, match="--kv-events-config reports the radix cache"):
        ServerArgs(kv_events_config="{}", disable_radix_cache=True)
    assert rank_endpoint("tcp://*:5557", 2) == "tcp://*:5559" and rank_endpoint("inproc://kv", 1) == "inproc://kv_dp1"


def test_batches_are_numbered_and_missed_ones_replayed() -> None:
    ctx = zmq.Context()
    cfg = KVEventsConfig(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", topic="kv")
    pub = VLLMEventPublisher(ctx, cfg, dp_rank=1, block_size=2)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(pub.endpoint)
    try:
        got: list[list[bytes]] = []
        deadline = time.monotonic() + 5
        while not got and time.monotonic() < deadline:  # the subscription takes a moment to reach the PUB
            pub.add(BlockStored([1, 2, 3, 4], 0))
            assert pub.flush()
            if sub.poll(100):
                got.append(sub.recv_multipart())
        topic, seq, payload = got[0]
        assert topic == b"kv" and int.from_bytes(seq, "big") == pub.seq - 1
        batch = DECODER.decode(payload)
        assert batch.data_parallel_rank == 1
        (ev,) = batch.events
        assert isinstance(ev, VLLMStored) and ev.token_ids == [1, 2, 3, 4] and ev.block_size == 2
        pub.add(AllCleared())
        pub.flush()
        assert not pub.flush()  # nothing new: no batch
        last = pub.seq - 1
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart([b"", (last - 1).to_bytes(8, "big")])
        replies = []
        while True:
            assert dealer.poll(5000)
            _, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                break
            replies.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
        assert [s for s, _ in replies] == [last - 1, last]
        assert isinstance(replies[-1][1].events[0], AllBlocksCleared)
        dealer.close(0)
    finally:
        sub.close(0)
        pub.close()
        ctx.term()


def test_the_payload_is_plain_msgpack() -> None:
    """Nothing radixserve-specific on the wire: a generic msgpack reader sees vLLM's map."""
    from radixserve.mem.vllm_events import KVEventBatch, encode_kv_batch, to_vllm

    raw = msgspec.msgpack.decode(encode_kv_batch(KVEventBatch(1.0, to_vllm([BlockStored([5, 6], 0)], 2))))
    assert raw["ts"] == 1.0 and "data_parallel_rank" not in raw  # omitted at its default
    assert raw["events"][0]["type"] == "BlockStored" and raw["events"][0]["token_ids"] == [5, 6]


@pytest.mark.slow
def test_a_real_server_publishes_what_its_cache_stores(shared_server: ServerProcess) -> None:
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(f"tcp://127.0.0.1:{shared_server.kv_events_port}")  # type: ignore[attr-defined]
    try:
        time.sleep(0.3)  # the subscription reaches the server's PUB socket
        prompt = list(range(1000, 1040))
        with shared_server.client() as c:
            r = c.post("/generate", json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 2}})
            assert r.status_code == 200, r.text
            stored: list[int] = []
            deadline = time.monotonic() + 10
            while stored[: len(prompt)] != prompt and time.monotonic() < deadline:
                if sub.poll(200):
                    _, _, payload = sub.recv_multipart()
                    for ev in DECODER.decode(payload).events:
                        if isinstance(ev, VLLMStored) and ev.parent_block_hash is None:
                            stored = ev.token_ids  # a path from the root (page size 1: a block a token)
            assert stored[: len(prompt)] == prompt
    finally:
        sub.close(0)
        ctx.term()


def test_the_router_follows_a_real_server_through_them(shared_server: ServerProcess) -> None:
    """``--enable-cache-events --cache-events-format vllm``: the router finds the endpoint in
    ``/get_server_info`` and a prompt the worker served (sent to it directly, so the router's own
    routing never saw it) appears in the router's tree under that worker."""
    prompt = list(range(2000, 2030))
    with router_in_thread([shared_server.url], policy="cache_aware", prefix_match="tokens",
                          enable_cache_events=True, cache_events_format="vllm") as fleet:
        router = fleet.router
        assert router is not None
        (w,) = router.workers.values()
        assert w.kv_events_endpoint == f"tcp://127.0.0.1:{shared_server.kv_events_port}"  # type: ignore[attr-defined]
        sub = router.fleet.subscribers[w.url]
        deadline = time.monotonic() + 20
        with shared_server.client() as c:
            while router.policy.tree.match(prompt)[0] < len(prompt) - 1:  # type: ignore[attr-defined]
                assert time.monotonic() < deadline, sub.stats()
                # (PUB drops what it sends before the subscription arrives: send until it shows)
                r = c.post("/generate", json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}})
                assert r.status_code == 200, r.text
                time.sleep(0.2)
        assert sub.errors == 0
