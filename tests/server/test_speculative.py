"""Speculative decoding through a real server (``--speculative-algorithm ngram``, float32): the
native API reports the drafts in ``meta_info``, greedy output and its logprobs equal a server's
without speculation token for token, streaming, the OpenAI API and concurrent requests work, ``/metrics``
counts drafts, and no KV is leaked."""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from importlib.resources import files

import httpx
import pytest

from tests.server.helpers import (
    ServerProcess,
    assert_memory_ok,
    free_port,
    post_disaggregated,
    started,
    wait_idle,
)

pytestmark = pytest.mark.slow

TEXT = files("radixserve.bench").joinpath("data/grounded.txt").read_text()
PROMPT = f"Here is a text:\n\n{TEXT}\n\nCopy its first paragraph word for word."


@pytest.fixture(scope="module")
def spec_server() -> Iterator[ServerProcess]:
    yield from started(ServerProcess("--speculative-algorithm", "ngram", "--dtype", "float32", "--enable-metrics"))


@pytest.fixture(scope="module")
def plain_server() -> Iterator[ServerProcess]:
    """The same server without speculation: the reference."""
    yield from started(ServerProcess("--dtype", "float32"))


def chat(client, sp: dict | None = None, **extra) -> dict:  # type: ignore[no-untyped-def]
    body = {"text": f"<|im_start|>user\n{PROMPT}<|im_end|>\n<|im_start|>assistant\n",
            "sampling_params": {"temperature": 0, "max_new_tokens": 64, **(sp or {})}, **extra}
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def flush(client) -> None:  # type: ignore[no-untyped-def]
    """Empty the prefix cache (once idle), so the next request prefills its whole prompt: a cache
    hit would compute its first token in a one-row step instead of the prefill's."""
    wait_idle(client)
    assert client.post("/flush_cache").status_code == 200


def test_greedy_output_equals_plain_decoding_and_meta_counts(spec_server: ServerProcess,
                                                             plain_server: ServerProcess) -> None:
    with spec_server.client() as c, plain_server.client() as pc:
        flush(c)
        spec = chat(c, return_logprob=True, top_logprobs_num=2)  # logprobs: reported for drafted tokens too
        flush(pc)
        plain = chat(pc, return_logprob=True, top_logprobs_num=2)
        assert spec["output_ids"] == plain["output_ids"]
        for key in ("output_token_logprobs", "output_top_logprobs"):
            assert spec["meta_info"][key] == plain["meta_info"][key]
        assert spec["meta_info"]["spec_verify_ct"] > 0 and spec["meta_info"]["spec_accepted_tokens"] > 0
        assert "spec_verify_ct" not in plain["meta_info"]
        assert_memory_ok(wait_idle(c))


def test_stream_openai_and_concurrent_requests(spec_server: ServerProcess) -> None:
    with spec_server.client() as c:
        want = chat(c)["text"]
        with c.stream("POST", "/generate", json={"text": f"<|im_start|>user\n{PROMPT}<|im_end|>\n<|im_start|>assistant\n",
                                                "sampling_params": {"temperature": 0, "max_new_tokens": 64},
                                                "stream": True}) as r:
            chunks = [line for line in r.iter_lines() if line.startswith("data: {")]
        assert len(chunks) > 1
        r = c.post("/v1/chat/completions", json={"model": "default", "messages": [{"role": "user", "content": PROMPT}],
                                                 "max_tokens": 64, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
        with ThreadPoolExecutor(3) as ex:
            outs = list(ex.map(lambda _: chat(c), range(3)))
        assert all(o["meta_info"]["completion_tokens"] == 64 for o in outs) and want
        metrics = c.get("/metrics").text
        accepted = [line for line in metrics.splitlines() if line.startswith("radixserve:spec_accepted_tokens_total")]
        assert accepted and float(accepted[0].split()[-1]) > 0
        assert "radixserve:spec_accept_length" in metrics
        assert_memory_ok(wait_idle(c))


def test_dashboard_shows_speculation(spec_server: ServerProcess) -> None:
    """The state the dashboard polls carries the scheduler's speculation counters, and the page
    renders them in a card of their own (in Chromium, where it is installed)."""
    from tests.server.test_dashboard import dashboard_page

    with spec_server.client() as c:
        chat(c)
        spec = c.get("/dashboard/state").json()["ranks"][0]["spec"]
        metrics = c.get("/metrics").text
    assert spec["algorithm"] == "ngram" and spec["verify_steps"] > 0 and 0 < spec["accept_rate"] <= 1
    drafted = next(line for line in metrics.splitlines() if line.startswith("radixserve:spec_draft_tokens_total"))
    assert float(drafted.split()[-1]) == spec["draft_tokens"]
    with dashboard_page(f"{spec_server.url}/dashboard", height=1400) as (page, errors):
        assert page.inner_text('[data-k="spec-accept-rate"]').endswith("%")
        drafted_shown, _ = page.inner_text('[data-k="spec-tokens"]').split(" / ")
        assert int(drafted_shown.replace(",", "")) >= spec["draft_tokens"] > 0
        assert page.inner_text('[data-k="spec-classes"]').count("%") == 3
    assert errors == []


@pytest.mark.parametrize("algorithm", ["ngram", "draft"])
def test_pd_decode_worker_with_data_parallel_ranks_drafts(plain_server: ServerProcess, algorithm: str) -> None:
    """A prefill worker hands the prompt's KV to a decode worker of two data-parallel ranks that
    speculates: the rank asked for drafts, and the answer is plain decoding's, token for token. A
    draft model (here the target's own file: its drafts are the target's tokens) reads the
    transferred prompt before its first draft, so nearly every draft is kept."""
    bport = free_port()
    prefill = ServerProcess("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bport),
                            "--dtype", "float32")
    decode = ServerProcess("--disaggregation-mode", "decode", "--dp-size", "2", "--speculative-algorithm", algorithm,
                           "--dtype", "float32")
    try:
        prefill.wait_ready()
        decode.wait_ready()
        with plain_server.client() as c:
            flush(c)
            want = chat(c)["output_ids"]
        body = {"text": f"<|im_start|>user\n{PROMPT}<|im_end|>\n<|im_start|>assistant\n",
                "sampling_params": {"temperature": 0, "max_new_tokens": 64}, "bootstrap_host": "127.0.0.1",
                "bootstrap_port": bport, "bootstrap_room": random.getrandbits(63), "data_parallel_rank_decode": 1}
        got = post_disaggregated(prefill.url, decode.url, body)
        assert got.status_code == 200, got.text
        out = got.json()
        assert out["meta_info"]["dp_rank"] == 1 and out["meta_info"]["spec_verify_ct"] > 0
        assert out["output_ids"] == want
        if algorithm == "draft":
            assert out["meta_info"]["spec_accept_length"] > 3
        with httpx.Client(base_url=decode.url, timeout=30) as dc:
            assert_memory_ok(wait_idle(dc))
    finally:
        prefill.kill()
        decode.kill()
