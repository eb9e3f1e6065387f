"""Bodies as the gateways people put in front of SGLang and vLLM workers send them: vLLM's router
re-sends OpenAI requests with SGLang's extension fields at their defaults, SGLang's gateway adds
its own fields to native ``/generate`` bodies. Every field either server defines is accepted at the
value that changes nothing and refused (400 ``unsupported``, naming it) at any other; a field
neither defines stays a 400 ``unknown_parameter``."""

from __future__ import annotations

import json
from typing import Any

import pytest

from radixserve.bench.fuzz import _without_noop_fields
from radixserve.sched.noop_fields import CHAT, COMPLETION, NATIVE, SAMPLING
from radixserve.sched.sampling_params import InvalidRequest, SamplingParams
from radixserve.server.frontend.chat_protocol import ChatCompletionRequest
from radixserve.server.frontend.protocol import APIError, CompletionRequest, GenerateRequest, parse_body
from tests.server.helpers import ServerProcess, assert_memory_ok, wait_idle

# what vLLM's router sends for a plain chat request (its SGLang extension fields at their defaults)
VLLM_ROUTER_CHAT = {
    "model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0,
    "stream": False, "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True,
    "continue_final_message": False, "separate_reasoning": True, "stream_reasoning": True,
    "include_reasoning": True, "return_hidden_states": False, "lora_path": None, "session_params": None,
    "stop_regex": None, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
}
VLLM_ROUTER_COMPLETION = {
    "model": "default", "prompt": "Hi", "max_tokens": 4, "temperature": 0, "no_stop_trim": False,
    "ignore_eos": False, "skip_special_tokens": True, "return_hidden_states": False,
    "spaces_between_special_tokens": True, "include_stop_str_in_output": False, "bad_words": [],
}
# what SGLang's gateway sends to a worker's native /generate
SGLANG_GATEWAY_GENERATE = {
    "text": "Hi", "model": "SmolLM2-135M-Instruct", "sampling_params": {"max_new_tokens": 4, "temperature": 0,
    "no_stop_trim": False, "spaces_between_special_tokens": True, "n": 1},
    "stream": False, "log_metrics": True, "no_logs": False, "return_bytes": False, "return_entropy": False,
    "return_text_in_logprobs": False, "background": False, "return_logprob": False,
}


def _parse(model: Any, body: dict[str, Any]) -> Any:
    return parse_body(json.dumps(body).encode(), model)


@pytest.mark.parametrize("model, body", [(ChatCompletionRequest, VLLM_ROUTER_CHAT),
                                         (CompletionRequest, VLLM_ROUTER_COMPLETION),
                                         (GenerateRequest, SGLANG_GATEWAY_GENERATE)])
def test_gateway_bodies_are_accepted(model: Any, body: dict[str, Any]) -> None:
    parsed = _parse(model, body)
    assert not set(parsed.model_extra or {}) & set(model.NOOP_FIELDS)  # dropped, not carried along
    if model is GenerateRequest:
        assert SamplingParams.from_dict(parsed.sampling_params).max_new_tokens == 4


@pytest.mark.parametrize("model, name, value", [
    (ChatCompletionRequest, "no_stop_trim", True), (ChatCompletionRequest, "continue_final_message", True),
    (ChatCompletionRequest, "stream_reasoning", False), (ChatCompletionRequest, "guided_json", {"type": "object"}),
    (CompletionRequest, "return_hidden_states", True), (CompletionRequest, "length_penalty", 2.0),
    (CompletionRequest, "no_stop_trim", 1),  # 1 is not false
    (GenerateRequest, "return_bytes", True), (GenerateRequest, "background", True),
    (GenerateRequest, "log_metrics", False), (GenerateRequest, "model", 3),
])
def test_a_field_away_from_its_no_op_value_is_refused_by_name(model: Any, name: str, value: Any) -> None:
    base = {ChatCompletionRequest: VLLM_ROUTER_CHAT, CompletionRequest: VLLM_ROUTER_COMPLETION,
            GenerateRequest: SGLANG_GATEWAY_GENERATE}[model]
    with pytest.raises(APIError) as e:
        _parse(model, {**base, name: value})
    assert (e.value.status_code, e.value.code, e.value.param) == (400, "unsupported", name)
    assert name in e.value.message


def test_no_op_values_accepted_include_null_and_equal_numbers() -> None:
    _parse(CompletionRequest, {**VLLM_ROUTER_COMPLETION, "length_penalty": 1, "guided_json": None})
    with pytest.raises(InvalidRequest, match="no_stop_trim") as e:
        SamplingParams.from_dict({"max_new_tokens": 2, "no_stop_trim": True})
    assert e.value.code == "unsupported"


def test_a_field_neither_server_defines_is_still_unknown() -> None:
    for model, base in ((ChatCompletionRequest, VLLM_ROUTER_CHAT), (GenerateRequest, SGLANG_GATEWAY_GENERATE)):
        with pytest.raises(APIError) as e:
            _parse(model, {**base, "no_such_field": False})
        assert (e.value.code, e.value.param) == ("unknown_parameter", "no_such_field")


def test_no_op_tables_do_not_shadow_what_is_honoured() -> None:
    """A no-op field is never one the model declares or reads as an extension: those are honoured."""
    for model, table in ((ChatCompletionRequest, CHAT), (CompletionRequest, COMPLETION), (GenerateRequest, NATIVE)):
        assert model.NOOP_FIELDS is table
        assert not set(table) & (set(model.model_fields) | set(model.EXTRA_FIELDS)), model.__name__
        schema = model.model_json_schema()
        props = schema["properties"]
        assert set(table) <= set(props) and all(props[n].get("x-noop") for n in table)  # in /openapi.json too
        assert not set(table) & set(_without_noop_fields(schema)["properties"])  # what the fuzzer leaves out
    assert not set(SAMPLING) & set(SamplingParams.__struct_fields__)


@pytest.mark.slow
def test_a_real_server_answers_the_gateways_bodies(shared_server: ServerProcess) -> None:
    with shared_server.client() as c:
        for path, body in (("/v1/chat/completions", VLLM_ROUTER_CHAT), ("/v1/completions", VLLM_ROUTER_COMPLETION),
                           ("/generate", SGLANG_GATEWAY_GENERATE)):
            r = c.post(path, json=body)
            assert r.status_code == 200, (path, r.text)
        r = c.post("/generate", json={**SGLANG_GATEWAY_GENERATE, "sampling_params": {"max_new_tokens": 2,
                                                                                     "no_stop_trim": True}})
        assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported"
        assert r.json()["error"]["param"] == "no_stop_trim"
        assert_memory_ok(wait_idle(c))
