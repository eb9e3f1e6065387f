"""SGLang's native endpoints, admin endpoints, aborts and client disconnects on a real server.
Every test that cuts a request short checks the KV memory invariant through /debug/memory."""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import httpx
import pytest

from tests.server.helpers import ServerProcess, assert_memory_ok, wait_idle

pytestmark = pytest.mark.slow  # real servers: the full tier only (scripts/test.sh --fast leaves it out)

# long enough that only an abort (not the end of generation) can make the server idle in time
LONG = {"max_new_tokens": 4000, "ignore_eos": True}


@pytest.fixture
def c(shared_server: ServerProcess) -> Any:
    with shared_server.client() as client:
        yield client


def test_generate_text_and_ids(c: httpx.Client) -> None:
    r = c.post("/generate", json={"text": "The capital of France is",
                                  "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
    assert r.status_code == 200
    out = r.json()
    meta = out["meta_info"]
    assert "Paris" in out["text"] and len(out["output_ids"]) == meta["completion_tokens"] <= 6
    assert meta["prompt_tokens"] > 0 and meta["e2e_latency"] > 0
    assert meta["finish_reason"]["type"] in ("stop", "length")
    assert set(meta) >= {"id", "prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason", "e2e_latency"}
    again = c.post("/generate", json={"input_ids": [1, 2, 3, 4], "rid": "native-ids-1", "priority": 3,
                                      "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}})
    assert again.status_code == 200 and again.json()["meta_info"]["id"] == "native-ids-1"
    assert again.json()["meta_info"]["completion_tokens"] == 3
    lp = c.post("/generate", json={"text": "Hello", "return_logprob": True, "top_logprobs_num": 2,
                                   "sampling_params": {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}})
    meta = lp.json()["meta_info"]
    assert [t for _, t, _ in meta["output_token_logprobs"]] == lp.json()["output_ids"]
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])


def test_generate_batch_and_errors(c: httpx.Client) -> None:
    r = c.post("/generate", json={"text": ["Hello", "Bonjour"], "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200 and len(r.json()) == 2
    r = c.post("/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 2, "bogus": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "bogus"
    r = c.post("/generate", json={"sampling_params": {}})
    assert r.status_code == 400
    r = c.post("/generate", json={"input_ids": [5] * 9000})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_generate_stream(c: httpx.Client) -> None:
    body = {"text": "Count to ten: one, two,", "stream": True,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
    with c.stream("POST", "/generate", json=body) as r:
        events = [ln[5:].strip() for ln in r.iter_lines() if ln.startswith("data:")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert chunks[-1]["meta_info"]["completion_tokens"] == 8
    texts = [ch["text"] for ch in chunks]
    assert all(texts[i + 1].startswith(texts[i]) for i in range(len(texts) - 1))  # cumulative, as SGLang
    full = c.post("/generate", json={**body, "stream": False}).json()
    assert texts[-1] == full["text"]


def test_flush_cache_resets_cached_tokens(c: httpx.Client) -> None:
    body = {"text": "A long shared system prompt about the history of computing. " * 4,
            "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    c.post("/generate", json=body)
    assert c.post("/generate", json=body).json()["meta_info"]["cached_tokens"] > 0
    wait_idle(c)
    r = c.post("/flush_cache")
    assert r.status_code == 200, r.text
    assert c.post("/generate", json=body).json()["meta_info"]["cached_tokens"] == 0
    assert_memory_ok(wait_idle(c))


def test_info_endpoints(c: httpx.Client, shared_server: ServerProcess) -> None:
    for path in ("/get_server_info", "/server_info"):
        info = c.get(path).json()
        assert info["dp_size"] == 1 and info["served_model_name"] and info["max_total_num_tokens"] == 8192
        assert info["port"] == shared_server.port and "memory" in info
    for path in ("/get_model_info", "/model_info"):
        info = c.get(path).json()
        assert info["is_generation"] is True and info["model_path"]
    load = c.get("/get_load").json()
    assert isinstance(load, list) and len(load) == 1
    assert set(load[0]) == {"dp_rank", "num_reqs", "num_waiting_reqs", "num_grammar_queue_reqs", "num_kv_loading_reqs", "num_tokens",
                            "num_used_tokens", "num_waiting_tokens", "prefill_tokens_per_s", "forward_steps"}
    assert load[0]["dp_rank"] == 0
    assert c.get("/health").status_code == 200
    r = c.get("/health_generate")
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 1


# What SGLang's gateway (smg) reads from a worker, written from its structs: every key optional,
# of these types when present (``ServerInfo``, ``ModelInfo``, the /v1/loads ``SchedulerLoadSnapshot``).
SMG_SERVER_INFO = {"model_path": str, "served_model_name": str, "tp_size": int, "dp_size": int, "pp_size": int,
                   "disaggregation_mode": str, "is_embedding": bool, "context_length": int,
                   "max_running_requests": int, "weight_version": str}
SMG_MODEL_INFO = {"model_path": str, "tokenizer_path": str, "is_generation": bool, "has_image_understanding": bool,
                  "has_audio_understanding": bool, "model_type": str, "architectures": list}
SMG_LOAD = {"dp_rank": int, "num_running_reqs": int, "num_waiting_reqs": int, "num_used_tokens": int,
            "max_total_num_tokens": int, "max_running_requests": int, "token_usage": float}


def test_what_sglangs_gateway_reads(c: httpx.Client) -> None:
    """The worker answers SGLang's gateway: the fields it parses are there with its types (a wrong
    type fails its parse), the model is described, and /v1/loads agrees with /get_load."""
    server, model = c.get("/server_info").json(), c.get("/model_info").json()
    for got, want in ((server, SMG_SERVER_INFO), (model, SMG_MODEL_INFO)):
        assert {k: type(got[k]) for k in want} == want, got
    assert model["architectures"] == ["LlamaForCausalLM"] and model["model_type"] == "llama"
    assert server["served_model_name"] == c.get("/v1/models").json()["data"][0]["id"]
    assert server["context_length"] == model["context_length"] > 0
    loads = c.get("/v1/loads", params={"include": "core,queues"}).json()
    assert loads["dp_rank_count"] == 1 and isinstance(loads["timestamp"], str)
    (rank,) = loads["loads"]
    assert {k: type(rank[k]) for k in SMG_LOAD} == SMG_LOAD
    assert rank["max_total_num_tokens"] == server["max_total_num_tokens"]
    assert 0 <= rank["token_usage"] <= 1 and rank["num_used_tokens"] <= rank["num_total_tokens"]
    # SGLang's /get_load: num_tokens is the KV in use plus what waits
    (old,) = c.get("/get_load").json()
    assert old["num_tokens"] == old["num_used_tokens"] + old["num_waiting_tokens"]


def test_metrics(c: httpx.Client) -> None:
    c.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}})
    deadline = time.monotonic() + 5
    while True:
        text = c.get("/metrics").text
        if "radixserve:generation_tokens_total" in text or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for name in ("radixserve:num_running_reqs", "radixserve:num_queue_reqs", "radixserve:token_usage",
                 "radixserve:cache_hit_rate", "radixserve:gen_throughput", "radixserve:generation_tokens_total",
                 "radixserve:time_to_first_token_seconds_bucket", "radixserve:time_per_output_token_seconds_bucket",
                 "radixserve:e2e_request_latency_seconds_bucket", "radixserve:queue_time_seconds_bucket",
                 "radixserve:num_retracted_reqs_total", "sglang:num_running_reqs", "sglang:token_usage",
                 "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:prefix_cache_hits_total"):
        assert name in text, name


def test_abort_request_frees_memory(c: httpx.Client) -> None:
    body = {"text": "Tell me a long story.", "rid": "native-abort-1", "stream": True, "sampling_params": LONG}
    with c.stream("POST", "/generate", json=body) as r:
        lines = r.iter_lines()
        first = json.loads(next(ln for ln in lines if ln.startswith("data:"))[5:])
        assert first["meta_info"]["finish_reason"] is None
        assert c.get("/get_load").json()[0]["num_reqs"] == 1
        assert c.post("/abort_request", json={"rid": "native-abort-1"}).json()["success"]
        events = [ln[5:].strip() for ln in lines if ln.startswith("data:")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert last["meta_info"]["completion_tokens"] < 4000
    assert_memory_ok(wait_idle(c))


def _running(c: httpx.Client) -> int:
    return int(c.get("/get_load").json()[0]["num_reqs"])


def _steps(c: httpx.Client) -> int:
    return int(c.get("/get_load").json()[0]["forward_steps"])


# Steps a request may still take after its client is gone: the step running when the abort
# arrives, the one the overlap loop (--overlap-schedule on) scheduled ahead, and one more for the
# HTTP process to see the closed socket on a busy machine. Measured with the overlap loop on a loaded
# 2-core machine: 2 in 35 of 36 trials, 3 once (`python scripts/reliability_probe.py disconnect`).
ABORT_STEPS = 3


def _assert_aborted_within_steps(c: httpx.Client, steps_before_close: int) -> None:
    """The request is gone and its KV and request slot are free, after at most ABORT_STEPS steps:
    nothing else runs on the engine, so its step counter stops once the request is gone."""
    assert_memory_ok(wait_idle(c))
    taken = _steps(c) - steps_before_close
    assert taken <= ABORT_STEPS, f"{taken} steps after the client left"


def test_stream_client_disconnect_aborts(c: httpx.Client, shared_server: ServerProcess) -> None:
    with httpx.Client(base_url=shared_server.url, timeout=60) as other:
        with other.stream("POST", "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 4000,
                                                           "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            for _ in range(3):  # a few tokens in: decoding
                next(ln for ln in lines if ln.startswith("data:"))
            assert _running(c) == 1
            before = _steps(c)
    # the client is gone: the request is aborted and its KV freed without waiting for 4000 tokens
    _assert_aborted_within_steps(c, before)


def test_non_stream_client_disconnect_aborts(c: httpx.Client, shared_server: ServerProcess) -> None:
    body = json.dumps({"text": "Once upon a time", "sampling_params": LONG}).encode()
    with socket.create_connection(("127.0.0.1", shared_server.port)) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 10
        while _running(c) == 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        start = _steps(c)
        while _steps(c) < start + 3:  # a few tokens in: decoding
            assert time.monotonic() < deadline + 20
            time.sleep(0.02)
        before = _steps(c)
    _assert_aborted_within_steps(c, before)


def test_http2_preface_is_refused_cleanly(shared_server: ServerProcess, c: httpx.Client) -> None:
    with socket.create_connection(("127.0.0.1", shared_server.port), timeout=5) as s:
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000"))
        data = b""
        while chunk := s.recv(4096):
            data += chunk
    head = data.split(b"\r\n", 1)[0]
    assert head.startswith(b"HTTP/1.1 505"), data
    assert b"connection: close" in data.lower()
    # the server still speaks HTTP/1.1
    assert c.get("/health").status_code == 200
    assert c.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 1}}).status_code == 200

