"""Prefill/decode disaggregation: a prefill worker and a decode worker, driven as the router drives
them (the same body to both, plus the bootstrap fields), against one colocated worker."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.server.helpers import ServerProcess, assert_memory_ok, free_port, wait_idle

pytestmark = pytest.mark.slow  # real servers: the full tier only (scripts/test.sh --fast leaves it out)

TIMEOUT_S = 3
PROMPTS = ["The capital of France is", "def fibonacci(n):"]


class PD:
    def __init__(self, colo: ServerProcess) -> None:
        self.bport = free_port()
        # the shared server is the colocated worker: the same model and dtype (auto) as these two
        common = ("--disaggregation-timeout-secs", str(TIMEOUT_S))
        self.colo = colo
        self.prefill = ServerProcess(*common, "--disaggregation-mode", "prefill",
                                     "--disaggregation-bootstrap-port", str(self.bport))
        self.decode = ServerProcess(*common, "--disaggregation-mode", "decode", "--max-total-tokens", "4096")
        self.pool = ThreadPoolExecutor(4)

    def servers(self) -> list[ServerProcess]:
        return [self.prefill, self.decode]

    def post(self, path: str, body: dict[str, Any], room: int | None = None,
             prefill: bool = True) -> httpx.Response:
        """What the router does: the same body to both workers at once, the decode worker's answer."""
        room = random.getrandbits(63) if room is None else room
        b = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": self.bport, "bootstrap_room": room}
        fp = self.pool.submit(httpx.post, self.prefill.url + path, json=b, timeout=60) if prefill else None
        fd = self.pool.submit(httpx.post, self.decode.url + path, json=b, timeout=60)
        if fp is not None:
            assert fp.result().status_code == 200, fp.result().text
        return fd.result()


@pytest.fixture(scope="module")
def pd(shared_server: ServerProcess) -> Iterator[PD]:
    p = PD(shared_server)
    try:
        for s in p.servers():
            s.wait_ready()
        yield p
        for s in p.servers():
            assert s.interrupt() == 0, s.log_text()[-3000:]
    finally:
        for s in p.servers():
            s.kill()
        p.pool.shutdown()


def disagg(srv: ServerProcess) -> dict[str, Any]:
    return dict(httpx.get(srv.url + "/debug/memory", timeout=10).json()["disagg"])


def native(prompt: str, n: int = 8, **kw: Any) -> dict[str, Any]:
    return {"text": prompt, "sampling_params": {"temperature": 0.0, "max_new_tokens": n}, **kw}


def test_server_info_reports_the_mode(pd: PD) -> None:
    info = httpx.get(pd.prefill.url + "/get_server_info", timeout=10).json()
    assert info["disaggregation_mode"] == "prefill" and info["disaggregation_bootstrap_port"] == pd.bport
    assert httpx.get(pd.decode.url + "/get_server_info", timeout=10).json()["disaggregation_mode"] == "decode"


def test_greedy_parity_with_a_colocated_worker(pd: PD) -> None:
    before = disagg(pd.decode)
    for prompt in PROMPTS:
        want = httpx.post(pd.colo.url + "/generate", json=native(prompt), timeout=60).json()
        got = pd.post("/generate", native(prompt)).json()
        assert got["output_ids"] == want["output_ids"], (prompt, got, want)
        assert got["text"] == want["text"]
        assert got["meta_info"]["completion_tokens"] == want["meta_info"]["completion_tokens"] == 8
        assert got["meta_info"]["finish_reason"]["type"] == "length"
    after = disagg(pd.decode)
    # the decode worker computed no prompt token: every prompt token came over the wire into its cache,
    # and each request's only extend was its first output token
    assert after["prompt_tokens"] - before["prompt_tokens"] == after["cached_tokens"] - before["cached_tokens"] > 0
    assert after["prefill_tokens"] - before["prefill_tokens"] == len(PROMPTS)
    assert after["rooms_received"] - before["rooms_received"] == len(PROMPTS)


def test_streamed_and_openai_parity(pd: PD) -> None:
    prompt = PROMPTS[0]
    want = httpx.post(pd.colo.url + "/generate", json=native(prompt, 10), timeout=60).json()
    r = pd.post("/generate", native(prompt, 10, stream=True))
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert chunks[-1]["text"] == want["text"], (chunks, want)
    # output_ids are cumulative: each chunk extends the last, so the first token is sent once
    assert chunks[-1]["output_ids"] == want["output_ids"]
    for prev, cur in zip(chunks, chunks[1:], strict=False):
        assert cur["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
    assert chunks[-1]["meta_info"]["completion_tokens"] == 10
    model = httpx.get(pd.colo.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    w = httpx.post(pd.colo.url + "/v1/completions", json=body, timeout=60).json()
    g = pd.post("/v1/completions", body).json()
    assert g["choices"][0]["text"] == w["choices"][0]["text"]
    assert g["usage"]["completion_tokens"] == w["usage"]["completion_tokens"] == 8


def test_transferred_bytes_are_pages_times_page_bytes(pd: PD) -> None:
    p, d = disagg(pd.prefill), disagg(pd.decode)
    assert p["tokens_sent"] > 0 and p["pages_sent"] * p["page_size"] == p["tokens_sent"]
    assert p["bytes_sent"] == p["pages_sent"] * p["page_size"] * p["kv_bytes_per_token"]
    assert d["bytes_received"] == p["bytes_sent"] and d["tokens_received"] == p["tokens_sent"]


def test_a_room_that_never_arrives_times_out_and_frees(pd: PD) -> None:
    before = disagg(pd.decode)
    r = pd.post("/generate", native("Nobody prefills this prompt"), prefill=False)
    # an error answer (504), or a result whose finish reason is the abort, depending on timing
    assert "no KV from the prefill worker" in r.text, r.text
    assert r.status_code == 504 or r.json()["meta_info"]["finish_reason"]["type"] == "abort", r.text
    assert disagg(pd.decode)["rooms_timed_out"] == before["rooms_timed_out"] + 1
    assert_memory_ok(wait_idle(pd.decode.client()))


def test_decode_worker_out_of_kv_refuses(pd: PD) -> None:
    body = {"input_ids": [100 + i % 1000 for i in range(3700)], "sampling_params": {"max_new_tokens": 4}}
    r = pd.post("/generate", body, prefill=False)
    assert r.status_code == 429 and "out of KV" in r.text, r.text
    model = httpx.get(pd.decode.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    r = pd.post("/v1/completions", {"model": model, "prompt": body["input_ids"], "max_tokens": 4}, prefill=False)
    assert r.status_code == 429, r.text


def test_through_the_router(pd: PD) -> None:
    """``radixserve router --pd-disaggregation`` in this process: it finds the bootstrap port in the
    prefill worker's server info, draws the rooms, and the client gets the colocated answer."""
    import asyncio

    from aiohttp import web

    from radixserve.router.app import create_app
    from radixserve.router.config import RouterArgs
    from radixserve.router.router import Router

    async def scenario() -> None:
        router = Router(RouterArgs(pd_disaggregation=True, prefill_urls=(pd.prefill.url,),
                                   decode_urls=(pd.decode.url,), policy="round_robin"))
        port = free_port()
        runner = web.AppRunner(create_app(router))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            assert router.workers[pd.prefill.url].bootstrap_port == pd.bport
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
                for prompt in PROMPTS:
                    want = httpx.post(pd.colo.url + "/generate", json=native(prompt), timeout=60).json()
                    got = (await c.post("/generate", json=native(prompt))).json()
                    assert got["output_ids"] == want["output_ids"], (prompt, got, want)
                chat = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                        "temperature": 0}
                want_chat = httpx.post(pd.colo.url + "/v1/chat/completions", json=chat, timeout=60).json()
                got_chat = (await c.post("/v1/chat/completions", json=chat)).json()
                assert got_chat["choices"][0]["message"] == want_chat["choices"][0]["message"]
            assert all(t.load == 0 for w in router.workers.values() for t in w.targets)
        finally:
            await runner.cleanup()

    asyncio.run(scenario())


LONG = {"input_ids": [100 + i % 1000 for i in range(1500)], "sampling_params": {"max_new_tokens": 4}}


def _poll(pred: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return False


def _kill_mid_request(pd: PD, survivor: ServerProcess, dead: ServerProcess, bport: int) -> httpx.Response:
    """Send LONG to both workers as the router would, kill ``dead`` while the 1,500-token prefill is
    under way, check its answer failed, and return the survivor's."""
    b = {**LONG, "bootstrap_host": "127.0.0.1", "bootstrap_port": bport, "bootstrap_room": random.getrandbits(63)}
    fs = pd.pool.submit(httpx.post, survivor.url + "/generate", json=b, timeout=60)
    fd = pd.pool.submit(httpx.post, dead.url + "/generate", json=b, timeout=60)
    time.sleep(0.3)  # both have the request
    dead.kill()
    assert fd.exception() is not None or fd.result().status_code >= 500
    return fs.result()


def test_a_worker_killed_mid_transfer_leaves_its_peer_serving(pd: PD) -> None:
    """Two faults at once, each with a doomed worker of its own (started together):
    - a decode worker dies while the prefill worker prefills for it: the prefill worker's room is
      never registered or never acknowledged, expires, drops its KV copy, and it keeps serving;
    - a prefill worker dies before its KV arrives: the decode worker's reservation expires with a
      clear error, its pool is back to idle, and it keeps serving."""
    bport = free_port()
    doomed_decode = ServerProcess("--disaggregation-mode", "decode", "--disaggregation-timeout-secs", str(TIMEOUT_S))
    doomed_prefill = ServerProcess("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bport),
                                   "--disaggregation-timeout-secs", str(TIMEOUT_S))
    try:
        doomed_decode.wait_ready()
        doomed_prefill.wait_ready()
        expired, timed_out = disagg(pd.prefill)["rooms_expired"], disagg(pd.decode)["rooms_timed_out"]
        with ThreadPoolExecutor(2) as faults:
            to_prefill = faults.submit(_kill_mid_request, pd, pd.prefill, doomed_decode, pd.bport)
            to_decode = faults.submit(_kill_mid_request, pd, pd.decode, doomed_prefill, bport)
            assert to_prefill.result().status_code == 200
            r = to_decode.result()
        assert "no KV from the prefill worker" in r.text, r.text
        assert r.status_code == 504 or r.json()["meta_info"]["finish_reason"]["type"] == "abort", r.text
        assert disagg(pd.decode)["rooms_timed_out"] == timed_out + 1
        assert _poll(lambda: disagg(pd.prefill)["rooms_expired"] > expired, TIMEOUT_S + 10)
    finally:
        doomed_decode.kill()
        doomed_prefill.kill()
    for srv in (pd.prefill, pd.decode):
        assert_memory_ok(wait_idle(srv.client(), timeout=TIMEOUT_S + 10))
    for prompt in PROMPTS:  # both still serve
        r = pd.post("/generate", native(prompt))
        assert r.status_code == 200 and r.json()["meta_info"]["finish_reason"]["type"] != "abort", r.text


def test_both_workers_idle_with_the_invariant(pd: PD) -> None:
    for srv in (pd.prefill, pd.decode):
        assert_memory_ok(wait_idle(srv.client(), timeout=TIMEOUT_S + 10))
        assert disagg(srv).get("rooms_waiting", 0) == 0
