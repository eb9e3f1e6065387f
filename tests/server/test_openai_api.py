"""The OpenAI API of a real server, through the official ``openai`` client."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from tests.server.helpers import ServerProcess, assert_memory_ok, wait_idle

pytestmark = pytest.mark.slow  # real servers: the full tier only (scripts/test.sh --fast leaves it out)

GREEDY: dict[str, Any] = {"temperature": 0.0}


@pytest.fixture(scope="module")
def client(shared_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{shared_server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from radixserve.model.tokenizer import Tokenizer

    return Tokenizer.from_model_path(None)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    models = client.models.list().data
    assert len(models) == 1
    return models[0].id


MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def test_models(client: openai.OpenAI, model: str) -> None:
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.status_code == 404 and e.value.code == "model_not_found"


def test_chat(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12, **GREEDY)
    assert r.object == "chat.completion" and r.model == model
    c = r.choices[0]
    assert c.message.role == "assistant" and "Paris" in (c.message.content or "")
    assert c.finish_reason in ("stop", "length")
    assert r.usage is not None and r.usage.prompt_tokens > 10
    assert 0 < r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_max_completion_tokens_and_priority(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(
        model=model, messages=MESSAGES, max_completion_tokens=3, extra_body={"priority": 5, "ignore_eos": True},
        **GREEDY,
    )
    assert r.usage is not None and r.usage.completion_tokens == 3
    assert r.choices[0].finish_reason == "length"


def test_chat_stream_matches_non_stream(client: openai.OpenAI, model: str) -> None:
    full = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=10, **GREEDY)
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=10, stream=True,
                                                  **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.usage is None for c in chunks)  # no usage unless asked
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_stream_include_usage(client: openai.OpenAI, model: str) -> None:
    chunks = list(client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=5, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True}, **GREEDY,
    ))
    *body, last = chunks
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 5 and last.usage.prompt_tokens > 0
    assert all(c.usage is None and len(c.choices) == 1 for c in body)
    assert body[-1].choices[0].finish_reason == "length"


def test_completions(client: openai.OpenAI, model: str, tokenizer: Any) -> None:
    r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=6, **GREEDY)
    assert r.object == "text_completion"
    assert "Paris" in r.choices[0].text
    assert r.usage is not None and r.usage.prompt_tokens == len(tokenizer.encode("The capital of France is"))


def test_completions_token_ids_and_batch(client: openai.OpenAI, model: str, tokenizer: Any) -> None:
    text = client.completions.create(model=model, prompt="The capital of France is", max_tokens=6, **GREEDY)
    ids = client.completions.create(model=model, prompt=tokenizer.encode("The capital of France is"), max_tokens=6,
                                    **GREEDY)
    assert ids.choices[0].text == text.choices[0].text  # the same five tokens
    batch = client.completions.create(model=model, prompt=["Hello", "The capital of France is"], max_tokens=6,
                                      **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[1].text == text.choices[0].text


def test_best_of_returns_the_most_likely_samples(client: openai.OpenAI, model: str) -> None:
    kw: dict[str, Any] = dict(model=model, prompt="My favourite colour is", max_tokens=6, temperature=1.0, seed=99,
                              extra_body={"ignore_eos": True})
    client.completions.create(**{**kw, "max_tokens": 1})  # the prompt in the prefix cache (see below)
    every = client.completions.create(**kw, n=3, logprobs=0)  # the same three samples best_of draws
    totals = [sum(c.logprobs.token_logprobs) for c in every.choices if c.logprobs and c.logprobs.token_logprobs]
    ranked = sorted(range(3), key=lambda i: -totals[i])
    best = client.completions.create(**kw, n=1, best_of=3)
    assert [c.text for c in best.choices] == [every.choices[ranked[0]].text] and best.choices[0].logprobs is None
    two = client.completions.create(**kw, n=2, best_of=3)
    assert [c.text for c in two.choices] == [every.choices[i].text for i in ranked[:2]]
    assert [c.index for c in two.choices] == [0, 1]
    assert best.usage is not None and every.usage is not None
    assert best.usage.completion_tokens == every.usage.completion_tokens == 18  # every sample drawn counts


def test_n_and_seeded_sampling(client: openai.OpenAI, model: str) -> None:
    kw: dict[str, Any] = dict(model=model, prompt="My favourite colour is", max_tokens=8, n=3, temperature=1.0,
                              top_p=0.95, seed=1234, extra_body={"ignore_eos": True, "top_k": 50, "min_p": 0.01})
    # the first call leaves the prompt in the prefix cache: the two compared calls take the same path
    # (bf16 numerics of a cached-prefix first token differ in the last bits from a cold prefill's)
    client.completions.create(**{**kw, "n": 1, "max_tokens": 1})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert len({c.text for c in a.choices}) > 1  # seed + i per choice: not three copies
    one = client.completions.create(**{**kw, "n": 1})
    # bf16 numerics depend on batch composition, so not == a.choices[0] (batch invariance: float32, tests/test_engine.py)
    assert client.completions.create(**{**kw, "n": 1}).choices[0].text == one.choices[0].text
    assert a.usage is not None and one.usage is not None
    assert a.usage.completion_tokens == 24 and a.usage.prompt_tokens == one.usage.prompt_tokens  # prompt once


def test_n_streaming_chat(client: openai.OpenAI, model: str) -> None:
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, n=2, stream=True,
                                                  seed=7, temperature=0.8))
    finished = {c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1}


def test_stop_string_across_chunks(client: openai.OpenAI, model: str) -> None:
    prompt = "Count: 1, 2, 3, 4, 5, 6,"
    full = client.completions.create(model=model, prompt=prompt, max_tokens=24, extra_body={"ignore_eos": True},
                                     **GREEDY).choices[0].text
    # a stop string made of the end of one streamed token and the start of the next
    stream = list(client.completions.create(model=model, prompt=prompt, max_tokens=24, stream=True,
                                            extra_body={"ignore_eos": True}, **GREEDY))
    pieces = [c.choices[0].text for c in stream if c.choices and c.choices[0].text]
    assert "".join(pieces) == full and len(pieces) > 6
    stop = ""
    for k in range(len(pieces) // 2, len(pieces)):  # first occurrence straddles the chunk boundary k
        pos = len("".join(pieces[:k]))
        cand = full[pos - 2 : pos + 1]
        if len(cand) == 3 and full.index(cand) == pos - 2:
            stop = cand
            break
    assert stop, pieces
    expected = full[: full.index(stop)]
    for stream_it in (False, True):
        r = client.completions.create(model=model, prompt=prompt, max_tokens=24, stop=[stop, "never-there"],
                                      stream=stream_it, extra_body={"ignore_eos": True}, **GREEDY)
        if stream_it:
            chunks = list(r)  # type: ignore[arg-type]
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            assert chunks[-1].choices[0].finish_reason == "stop"
        else:
            text = r.choices[0].text  # type: ignore[union-attr]
        assert text == expected, (stop, text, expected)
        assert stop not in text


def test_chat_stop_string(client: openai.OpenAI, model: str) -> None:
    full = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12, **GREEDY)
    content = full.choices[0].message.content or ""
    assert " of " in content
    r = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12, stop=" of", **GREEDY)
    assert r.choices[0].message.content == content[: content.index(" of")]
    assert r.choices[0].finish_reason == "stop"


def test_logprobs(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, logprobs=True, top_logprobs=3,
                                       extra_body={"ignore_eos": True}, **GREEDY)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.content is not None and len(lp.content) == 4
    for tok in lp.content:
        assert tok.logprob <= 0 and len(tok.top_logprobs) == 3
        assert tok.top_logprobs[0].logprob == pytest.approx(tok.logprob, abs=1e-4)  # greedy: the top token
    assert "".join(t.token for t in lp.content) == r.choices[0].message.content
    c = client.completions.create(model=model, prompt="The capital of France is", max_tokens=3, logprobs=2,
                                  **GREEDY)
    clp = c.choices[0].logprobs
    assert clp is not None and clp.tokens is not None and len(clp.tokens) == 3
    assert clp.token_logprobs is not None and all(x <= 0 for x in clp.token_logprobs)
    assert clp.top_logprobs is not None and all(len(t) == 2 for t in clp.top_logprobs)
    s = list(client.completions.create(model=model, prompt="The capital of France is", max_tokens=3, logprobs=1,
                                       stream=True, **GREEDY))
    streamed = [t for ch in s if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens or []]
    assert streamed == clp.tokens


def test_echo_with_prompt_logprobs(client: openai.OpenAI, model: str, shared_server: ServerProcess,
                                   tokenizer: Any) -> None:
    """``echo`` + ``logprobs``: the prompt's tokens lead (the first one's logprob null), then the
    outputs'; the same numbers as /generate's ``logprob_start_len``; streamed the same; a prompt token
    that the model would have produced gets the logprob its output had."""
    prompt = "The capital of France is"
    ids = tokenizer.encode(prompt)
    c = client.completions.create(model=model, prompt=prompt, max_tokens=2, logprobs=2, echo=True, **GREEDY)
    lp = c.choices[0].logprobs
    assert c.choices[0].text.startswith(prompt)
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.tokens) == len(ids) + 2 and "".join(lp.tokens[: len(ids)]) == prompt
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert all(len(t) == 2 for t in lp.top_logprobs[1:])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(len(lp.tokens))]
    streamed = list(client.completions.create(model=model, prompt=prompt, max_tokens=2, logprobs=2, echo=True,
                                              stream=True, **GREEDY))
    got = [x for ch in streamed if ch.choices and ch.choices[0].logprobs for x in ch.choices[0].logprobs.token_logprobs]
    assert got == pytest.approx(lp.token_logprobs, abs=1e-4)
    # the first output token, appended to the prompt: its prompt logprob is the logprob it had as an output
    first = tokenizer.encode(lp.tokens[len(ids)])
    with shared_server.client() as h:
        r = h.post("/generate", json={"input_ids": ids + first, "return_logprob": True, "logprob_start_len": 1,
                                      "return_text_in_logprobs": True,
                                      "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
        assert r.status_code == 200, r.text
        meta = r.json()["meta_info"]
        entries = meta["input_token_logprobs"]
        assert [t for _, t, _ in entries] == (ids + first)[1:] and entries[0][2] == lp.tokens[1]
        assert [v for v, _, _ in entries[: len(ids) - 1]] == pytest.approx(lp.token_logprobs[1 : len(ids)], abs=1e-3)
        assert entries[-1][0] == pytest.approx(lp.token_logprobs[len(ids)], abs=1e-3)
        bad = [h.post("/generate", json={"input_ids": ids, "return_logprob": True, "logprob_start_len": n})
               for n in (len(ids), -2)]
        assert [b.status_code for b in bad] == [400, 400]
        assert all(b.json()["error"]["param"] == "logprob_start_len" for b in bad)
        assert_memory_ok(wait_idle(h))


def test_multibyte_utf8_stream(client: openai.OpenAI, model: str, tokenizer: Any) -> None:
    """Greedy emoji after emoji: every other token is half a character. No streamed chunk may carry
    U+FFFD, and the stream must add up to the non-streamed text."""
    kw: dict[str, Any] = dict(model=model, prompt="Emoji list: 😀 😃 😄 😁 😆 😅", max_tokens=16, **GREEDY)
    full = client.completions.create(**kw, extra_body={"return_token_ids": True}).choices[0]
    ids = full.model_extra["token_ids"] if full.model_extra else []
    assert len(ids) == 16 and tokenizer.decode(ids) == full.text
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids), full.text  # partial characters were generated
    assert any(ord(ch) > 0x7F for ch in full.text) and "\ufffd" not in full.text
    chunks = [c.choices[0].text for c in client.completions.create(**kw, stream=True) if c.choices]
    assert all("\ufffd" not in ch for ch in chunks), chunks
    assert "".join(chunks) == full.text


def test_return_token_ids(client: openai.OpenAI, model: str, tokenizer: Any) -> None:
    kw: dict[str, Any] = dict(model=model, prompt="The capital of France is", max_tokens=5,
                              extra_body={"ignore_eos": True, "return_token_ids": True}, **GREEDY)
    full = client.completions.create(**kw).choices[0].model_extra or {}
    assert full["prompt_token_ids"] == tokenizer.encode("The capital of France is") and len(full["token_ids"]) == 5
    chunks = [c.choices[0].model_extra or {} for c in client.completions.create(**kw, stream=True) if c.choices]
    assert [t for ch in chunks for t in ch["token_ids"]] == full["token_ids"]
    assert chunks[0]["prompt_token_ids"] == full["prompt_token_ids"]
    assert all("prompt_token_ids" not in ch for ch in chunks[1:])


# --- errors ---------------------------------------------------------------------------------------
def _err(e: openai.APIStatusError) -> dict[str, Any]:
    body = e.body if isinstance(e.body, dict) else {}
    return body.get("error", body)


def test_unknown_model(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-17", messages=MESSAGES, max_tokens=2)
    assert e.value.status_code == 404 and e.value.code == "model_not_found"
    assert _err(e.value)["param"] == "model"


@pytest.mark.parametrize("kw,param", [
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"extra_body": {"top_k": -7}}, "top_k"),
    ({"top_logprobs": 50, "logprobs": True}, "top_logprobs"),
    ({"stop": [""]}, "stop"),
])
def test_validation_errors_are_400(client: openai.OpenAI, model: str, kw: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=MESSAGES, **{"max_tokens": 2, **kw})
    assert e.value.status_code == 400
    err = _err(e.value)
    assert err["param"] == param and isinstance(err["code"], str) and err["type"] == "invalid_request_error"


def test_context_length_exceeded(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="Hello", max_tokens=100_000)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt=[42] * 9000, max_tokens=1)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:  # also when streaming: before the stream starts
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=100_000, stream=True)
    assert e.value.code == "context_length_exceeded"


def test_malformed_json_and_bad_types(shared_server: ServerProcess) -> None:
    with shared_server.client() as c:
        for body in (b"{not json", b"[1, 2]", b""):
            r = c.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
            assert r.status_code == 400
            assert r.json()["error"]["code"] == "invalid_json"
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": "many"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        r = c.post("/v1/chat/completions", json={"max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        r = c.post("/v1/completions", json={"prompt": [1, 99_999_999], "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        r = c.get("/v1/nowhere")
        assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_error_after_stream_started_is_an_sse_event(
    client: openai.OpenAI, model: str, shared_server: ServerProcess
) -> None:
    """A stream the server cuts short (here: /abort_request abort_all) ends with a
    ``data: {"error": ...}`` event, which the openai client raises; its KV is freed."""
    stream = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=400, stream=True,
                                            extra_body={"ignore_eos": True})
    got = 0
    with pytest.raises(openai.APIError) as e, shared_server.client() as c:
        for _ in stream:
            got += 1
            if got == 2:
                assert c.post("/abort_request", json={"abort_all": True}).json()["success"]
    assert got >= 2 and "abort" in str(e.value.message).lower()
    assert type(e.value) is openai.APIError and e.value.code == "aborted"  # the event, not an HTTP status
    with shared_server.client() as c:
        assert_memory_ok(wait_idle(c))


def test_raw_sse_format(shared_server: ServerProcess) -> None:
    with httpx.Client(base_url=shared_server.url, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 3, "stream": True,
                                                            "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            events = [ln for ln in r.iter_lines() if ln]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    usage_chunk = json.loads(events[-2][6:])
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] <= 3
