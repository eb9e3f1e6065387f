"""The API's edges on a real server: malformed input of any shape is a 400 (never a 5xx), request
bodies have a size limit (413), ``/openapi.json`` documents every route (behind ``--api-key``),
every field is honoured or refused (docs/api.md lists them), penalties over HTTP."""

from __future__ import annotations

import os
import random
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from radixserve.bench.fuzz import FIELDS, mutate
from radixserve.server.frontend.chat_protocol import ChatCompletionRequest
from radixserve.server.frontend.protocol import CompletionRequest, GenerateRequest
from radixserve.server.frontend.responses_protocol import ResponsesRequest
from tests.server.helpers import REPO, ServerProcess, assert_memory_ok, wait_idle

pytestmark = pytest.mark.slow  # real servers: the full tier only (scripts/test.sh --fast leaves it out)

POST_ROUTES = ("/v1/completions", "/v1/chat/completions", "/generate", "/v1/responses")
MESSAGES = [{"role": "user", "content": "Say hello."}]
VALID: dict[str, dict[str, Any]] = {
    "/v1/completions": {"prompt": "Hello", "max_tokens": 2, "temperature": 0},
    "/v1/chat/completions": {"messages": MESSAGES, "max_tokens": 2, "temperature": 0},
    "/generate": {"text": "Hello", "sampling_params": {"max_new_tokens": 2, "temperature": 0}},
    "/v1/responses": {"input": "Say hello.", "max_output_tokens": 2, "temperature": 0},
}


@pytest.fixture
def c(shared_server: ServerProcess) -> Iterator[httpx.Client]:
    with shared_server.client() as client:
        yield client


def _error(r: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


# --- malformed input ---------------------------------------------------------------------------------
MALFORMED: dict[str, bytes] = {
    "nested arrays": b"[" * 5000,
    "nested in a field": b'{"text": ' + b"[" * 3000 + b"]" * 3000 + b"}",
    "nested objects": b'{"a": ' * 2000 + b"1" + b"}" * 2000,
    "NaN": b'{"prompt": "hi", "temperature": NaN}',
    "Infinity": b'{"prompt": "hi", "temperature": -Infinity}',
    "number out of range": b'{"prompt": "hi", "temperature": 1e999}',
    "invalid UTF-8": b'{"prompt": "\xff\xfe\xc3", "max_tokens": 2}',
    "lone surrogate": b'{"prompt": "\\ud800", "text": "\\udfff", "max_tokens": 2}',
    "truncated": b'{"prompt": "hi", "max_tokens":',
    "not an object": b'"hello"',
    "empty": b"",
    "binary": bytes(range(256)),
}


@pytest.mark.parametrize("route", POST_ROUTES)
@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_json_is_400(c: httpx.Client, route: str, name: str) -> None:
    err = _error(c.post(route, content=MALFORMED[name], headers={"Content-Type": "application/json"}))
    assert err["code"] == "invalid_json" and err["type"] == "invalid_request_error"


HUGE = 10**40
BAD_VALUES: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/completions", {"max_tokens": HUGE}, "max_tokens"),
    ("/v1/completions", {"seed": HUGE}, "seed"),
    ("/v1/completions", {"priority": -HUGE}, "priority"),
    ("/v1/completions", {"prompt": [HUGE]}, "prompt"),
    ("/v1/completions", {"prompt": {"a": 1}}, "prompt"),
    ("/v1/completions", {"stop": [["x"]]}, "stop"),
    ("/v1/completions", {"temperature": "hot"}, "temperature"),
    ("/v1/completions", {"stream": "yes"}, "stream"),
    ("/v1/completions", {"n": True}, "n"),
    ("/v1/completions", {"n": 2.0}, "n"),
    ("/v1/completions", {"logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"5": 1000}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"99999999": 1}}, "logit_bias"),
    ("/v1/completions", {"frequency_penalty": 3}, "frequency_penalty"),
    ("/v1/completions", {"presence_penalty": -2.5}, "presence_penalty"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"min_tokens": 5}, "min_tokens"),
    ("/v1/completions", {"stop_token_ids": [HUGE]}, "stop_token_ids"),
    ("/v1/completions", {"top_k": HUGE}, "top_k"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "x": 1}]}, "messages[0].x"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"max_completion_tokens": -1}, "max_completion_tokens"),
    ("/v1/chat/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {"metadata": {"k": 1}}, "metadata"),
    ("/generate", {"text": None, "input_ids": [HUGE]}, "input_ids"),
    ("/generate", {"text": None, "input_ids": [[1, 2], "x"]}, "input_ids"),
    ("/generate", {"sampling_params": {"max_new_tokens": HUGE}}, "max_new_tokens"),
    ("/generate", {"sampling_params": {"temperature": [1]}}, "temperature"),
    ("/generate", {"sampling_params": {"seed": -HUGE}}, "seed"),
    ("/generate", {"sampling_params": {"skip_special_tokens": "no"}}, "skip_special_tokens"),
    ("/generate", {"sampling_params": {"logit_bias": [1]}}, "logit_bias"),
    ("/generate", {"sampling_params": {"min_new_tokens": 3, "max_new_tokens": 2}}, "min_new_tokens"),
    ("/generate", {"sampling_params": "fast"}, "sampling_params"),
    ("/generate", {"priority": HUGE}, "priority"),
    ("/generate", {"rid": 5}, "rid"),
    ("/generate", {"top_logprobs_num": 21}, "top_logprobs_num"),
    ("/generate", {"deadline_ms": "soon"}, "deadline_ms"),
    ("/v1/responses", {"input": 5}, "input"),
    ("/v1/responses", {"input": [{"role": "wizard", "content": "hi"}]}, "input[0].role"),
    ("/v1/responses", {"max_output_tokens": HUGE}, "max_output_tokens"),
    ("/v1/responses", {"tools": [{"type": "function"}]}, "tools[0].name"),
    ("/v1/responses", {"text": {"format": {"type": "json_schema"}}}, "text.format.name"),
]


@pytest.mark.parametrize("route,patch,param", BAD_VALUES)
def test_wrong_types_and_huge_numbers_are_400(c: httpx.Client, route: str, patch: dict[str, Any], param: str) -> None:
    err = _error(c.post(route, json={**VALID[route], **patch}))
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error"


def test_schedule_policy_param_past_64_bits_is_400(c: httpx.Client) -> None:
    """Found by schemathesis: the parameters go to the scheduler as msgpack (64-bit integers)."""
    for value in (10**22, [1, -(2**70)], {"k": 2**64}):
        err = _error(c.post("/set_schedule_policy", json={"priority_aging_horizon": value}))
        assert err["param"] == "priority_aging_horizon" and err["code"] == "invalid_value"
    assert c.get("/get_server_info").json()["schedule_policy"] == "fcfs"


@pytest.mark.parametrize("route", POST_ROUTES)
def test_unknown_field_is_400(c: httpx.Client, route: str) -> None:
    err = _error(c.post(route, json={**VALID[route], "frobnicate": 1}))
    assert err["code"] == "unknown_parameter" and err["param"] == "frobnicate"


def test_mutation_fuzzer_knows_every_field() -> None:
    for model in (ChatCompletionRequest, CompletionRequest, GenerateRequest, ResponsesRequest):
        assert not (set(model.model_fields) | set(model.EXTRA_FIELDS)) - set(FIELDS), model.__name__


def test_mutation_fuzz_never_5xx(c: httpx.Client) -> None:
    """Valid bodies with random fields replaced by random values (wrong types, huge numbers, deep
    nesting, odd Unicode, unknown names): every answer is < 500; the server stays healthy."""
    rng = random.Random(11)
    statuses: dict[int, int] = {}
    for i in range(360):
        route = POST_ROUTES[i % len(POST_ROUTES)]
        body = mutate(rng, VALID[route])
        r = c.post(route, json=body)
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert r.status_code < 500, (route, body, r.text[:500])
        if r.status_code >= 400:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert statuses.get(400, 0) > 100 and statuses.get(200, 0) > 10, statuses
    assert c.get("/health").status_code == 200
    assert_memory_ok(wait_idle(c))


# --- body size limit -----------------------------------------------------------------------------------
def test_body_limit_content_length_and_chunked(keyed_server: ServerProcess) -> None:
    with keyed_server.client() as c:
        small = {"prompt": "Hi", "max_tokens": 1}
        assert c.post("/v1/completions", json=small).status_code == 200
        big = {"prompt": "x" * 5000, "max_tokens": 1}
        err = _error(c.post("/v1/completions", json=big), 413)
        assert err["code"] == "request_too_large" and "4096" in err["message"]

        def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
            yield b'{"prompt": "'
            for _ in range(10):
                yield b"x" * 1000
            yield b'", "max_tokens": 1}'

        err = _error(c.post("/generate", content=chunks(), headers={"Content-Type": "application/json"}), 413)
        assert err["code"] == "request_too_large"
        assert c.get("/health").status_code == 200


def test_default_body_limit_is_16_mib(c: httpx.Client) -> None:
    r = c.post("/v1/completions", content=b"{" + b" " * (16 * 1024 * 1024) + b"}",
               headers={"Content-Type": "application/json"})
    assert _error(r, 413)["code"] == "request_too_large"


# --- OpenAPI ---------------------------------------------------------------------------------------
def test_openapi_documents_every_route_with_request_schemas(c: httpx.Client, shared_server: ServerProcess) -> None:
    doc = c.get("/openapi.json").json()
    paths = doc["paths"]
    for route in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/v1/models/{model_id}", "/generate",
                  "/health", "/health_generate", "/get_server_info", "/get_model_info", "/flush_cache",
                  "/abort_request", "/set_schedule_policy", "/get_load", "/metrics", "/debug/memory"):
        assert route in paths, route
    ids = [op["operationId"] for ops in paths.values() for op in ops.values()]
    assert len(ids) == len(set(ids)), sorted(ids)
    schemas = doc["components"]["schemas"]
    for route, name in (("/v1/chat/completions", "ChatCompletionRequest"), ("/v1/completions", "CompletionRequest"),
                        ("/v1/responses", "ResponsesRequest"), ("/generate", "GenerateRequest"),
                        ("/abort_request", "AbortRequest"),
                        ("/set_schedule_policy", "SchedulePolicyRequest")):
        body = paths[route]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{name}"}
        assert "400" in paths[route]["post"]["responses"] and "413" in paths[route]["post"]["responses"]
    chat = schemas["ChatCompletionRequest"]
    assert chat["required"] == ["messages"] and chat["additionalProperties"] is False
    for field in ("frequency_penalty", "presence_penalty", "logit_bias", "repetition_penalty", "min_tokens",
                  "tools", "response_format", "ttft_slo_ms", "data_parallel_rank"):
        assert field in chat["properties"], field
    assert "sampling_params" in schemas["GenerateRequest"]["properties"]
    assert schemas["ErrorResponse"]["properties"]["error"]


def test_openapi_needs_the_api_key(keyed_server: ServerProcess) -> None:
    r = httpx.get(f"{keyed_server.url}/openapi.json")
    assert _error(r, 401)["code"] == "invalid_api_key"
    r = httpx.get(f"{keyed_server.url}/openapi.json", headers=keyed_server.headers)
    assert r.status_code == 200 and "/v1/chat/completions" in r.json()["paths"]


# --- refused, never silently ignored ------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(shared_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{shared_server.url}/v1", api_key="unused", max_retries=0, timeout=60)


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("kw,param", [
    ({"tools": [TOOL]}, "tool_choice"),  # auto: this server runs no --tool-call-parser
    ({"store": True}, "store"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"reasoning_effort": "low"}, "reasoning_effort"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"extra_body": {"functions": [{"name": "f"}]}}, "functions"),
])
def test_unsupported_features_are_refused(client: openai.OpenAI, kw: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=2, **kw)  # type: ignore[call-overload]
    assert e.value.code == "unsupported"
    assert isinstance(e.value.body, dict) and e.value.body["param"] == param


def test_accepted_noops(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="default", messages=[*MESSAGES, {"role": "assistant", "content": "Hi", "refusal": None},
                                   {"role": "user", "content": "Again."}],
        max_tokens=2, response_format={"type": "text"}, tool_choice="none", store=False, metadata={"k": "v"},
        service_tier="auto", prompt_cache_key="abc", safety_identifier="tenant-a", modalities=["text"],
        temperature=0)
    assert r.choices[0].message.content is not None


def test_completions_refusals(client: openai.OpenAI) -> None:
    for kw, param in (({"suffix": "end"}, "suffix"), ({"best_of": 1, "n": 2}, "best_of"),
                      ({"best_of": 3, "stream": True}, "best_of")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="default", prompt="Hi", max_tokens=2, **kw)  # type: ignore[call-overload]
        assert isinstance(e.value.body, dict) and e.value.body["param"] == param
    assert client.completions.create(model="default", prompt="Hi", max_tokens=2, best_of=1).choices


# --- penalties over HTTP -----------------------------------------------------------------------------
def test_logit_bias_and_min_tokens(client: openai.OpenAI, c: httpx.Client) -> None:
    prompt = "Count: one, two, three,"
    first = c.post("/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    tok = first.json()["output_ids"][0]
    forced = client.completions.create(model="default", prompt=prompt, max_tokens=4, temperature=0,
                                       logit_bias={str(tok + 1): 100},
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    assert (forced.choices[0].model_extra or {})["token_ids"] == [tok + 1] * 4
    out = c.post("/generate", json={"text": prompt, "sampling_params": {
        "max_new_tokens": 8, "min_new_tokens": 3, "temperature": 0, "stop_token_ids": [tok],
        "logit_bias": {str(tok): 100}}}).json()
    assert len(out["output_ids"]) == 4 and out["output_ids"][-1] == tok
    r = client.completions.create(model="default", prompt=prompt, max_tokens=8, temperature=0, logit_bias={str(tok): 100},
                                  extra_body={"min_tokens": 2, "stop_token_ids": [tok], "return_token_ids": True})
    assert len((r.choices[0].model_extra or {})["token_ids"]) == 3


def test_frequency_presence_repetition_change_greedy_output(client: openai.OpenAI, c: httpx.Client) -> None:
    kw: dict[str, Any] = dict(model="default", prompt="Count: one, two, three,", max_tokens=16, temperature=0)
    ign = {"ignore_eos": True}

    def text(**extra: Any) -> str:
        return client.completions.create(**kw, **extra).choices[0].text

    plain = text(extra_body=ign)
    assert text(frequency_penalty=2.0, presence_penalty=2.0, extra_body=ign) != plain
    assert text(extra_body={**ign, "repetition_penalty": 2.0}) != plain
    # neighbours without penalties are untouched (greedy parity): the same text beside penalized ones
    with ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(text, **extra) for extra in (
            {"frequency_penalty": 1.0, "extra_body": ign}, {"extra_body": ign},
            {"extra_body": {**ign, "repetition_penalty": 1.5, "min_tokens": 3}}, {"extra_body": ign})]
        texts = [f.result() for f in futs]
    assert texts[1] == texts[3] == plain
    assert_memory_ok(wait_idle(c))


# --- the field list in docs/api.md -----------------------------------------------------------------
def test_docs_list_every_field() -> None:
    with open(os.path.join(REPO, "docs", "api.md")) as f:
        doc = f.read()
    first_cells = re.findall(r"^\|([^|\n]*)\|", doc, flags=re.M)  # a table row's first cell
    listed = {name for cell in first_cells for name in re.findall(r"`([a-z_]+)`", cell)}
    for model in (ChatCompletionRequest, CompletionRequest, GenerateRequest, ResponsesRequest):
        missing = (set(model.model_fields) | set(model.EXTRA_FIELDS)) - listed
        assert not missing, (model.__name__, sorted(missing))
    from radixserve.sched.sampling_params import SamplingParams

    assert not set(SamplingParams.__struct_fields__) - listed
