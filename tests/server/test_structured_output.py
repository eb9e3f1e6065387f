"""Structured output over HTTP, as clients ask for it: OpenAI's ``response_format`` (``json_object``,
``json_schema``) through the official client, streamed and not, SGLang's ``json_schema`` / ``regex``
/ ``ebnf`` sampling params on ``/generate``, and the 400s for grammars that are not valid."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.server.helpers import ServerProcess

pytestmark = pytest.mark.slow  # real servers: the full tier only (scripts/test.sh --fast leaves it out)

ITEM = {
    "type": "object",
    "properties": {"item": {"type": "string", "maxLength": 16}, "price": {"type": "number", "minimum": 0},
                   "in_stock": {"type": "boolean"}},
    "required": ["item", "price", "in_stock"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe one product of a bakery as JSON."}]


@pytest.fixture(scope="module")
def client(shared_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{shared_server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def c(shared_server: ServerProcess) -> httpx.Client:
    return httpx.Client(base_url=shared_server.url, timeout=120)


def _schema_format(schema: dict[str, Any]) -> Any:
    return {"type": "json_schema", "json_schema": {"name": "product", "schema": schema, "strict": True}}


def test_chat_json_schema_and_json_object(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=80, temperature=0,  # type: ignore[call-overload]
                                       response_format=_schema_format(ITEM))
    choice = r.choices[0]
    jsonschema.validate(json.loads(choice.message.content or ""), ITEM)
    assert choice.finish_reason == "stop"
    r = client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=80, n=2, temperature=1.0,  # type: ignore[call-overload]
                                       seed=11, response_format={"type": "json_object"})
    for ch in r.choices:
        if ch.finish_reason == "stop":  # a sampled object may still run out of tokens: then it is cut
            assert isinstance(json.loads(ch.message.content or ""), dict)
        else:
            assert ch.finish_reason == "length" and (ch.message.content or "").startswith("{")


def test_the_openai_clients_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    """``chat.completions.parse``: the client sends the model's strict JSON schema and reads the
    answer back into the model."""
    import pydantic

    class Product(pydantic.BaseModel):
        item: str = pydantic.Field(max_length=16)
        in_stock: bool

    r = client.chat.completions.parse(model="default", messages=MESSAGES, max_tokens=60,  # type: ignore[arg-type]
                                      temperature=0, response_format=Product)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Product) and r.choices[0].finish_reason == "stop"


def test_chat_stream_follows_the_schema(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=80, temperature=0,  # type: ignore[call-overload]
                                            response_format=_schema_format(ITEM), stream=True)
    text, reasons = "", []
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reasons.append(chunk.choices[0].finish_reason)
    jsonschema.validate(json.loads(text), ITEM)
    assert reasons[-1] == "stop"


def test_native_regex_ebnf_and_schema(c: httpx.Client) -> None:
    body = {"text": ["The date today is", "Pick a colour:", "A JSON list of two small numbers:"],
            "sampling_params": [
                {"max_new_tokens": 20, "temperature": 0, "regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"},
                {"max_new_tokens": 20, "temperature": 0.8, "ebnf": 'root ::= "red" | "green" | "blue"'},
                {"max_new_tokens": 40, "temperature": 0, "json_schema": {
                    "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                    "minItems": 2, "maxItems": 2}},
            ]}
    outs = c.post("/generate", json=body).json()
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", outs[0]["text"])
    assert outs[1]["text"] in ("red", "green", "blue")
    nums = json.loads(outs[2]["text"])
    assert len(nums) == 2 and all(0 <= n <= 9 for n in nums)
    r = c.post("/v1/completions", json={"model": "default", "prompt": "Year:", "max_tokens": 8, "temperature": 0,
                                        "regex": "(19|20)[0-9]{2}"})
    assert re.fullmatch(r"(19|20)[0-9]{2}", r.json()["choices"][0]["text"])


@pytest.mark.parametrize("route,body,param", [
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": _schema_format({"type": "objectx"})},
     "response_format"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_schema"}},
     "response_format.json_schema"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_object", "json_schema": {
        "name": "x"}}}, "response_format.json_schema"),
    ("/v1/chat/completions", {"messages": MESSAGES, "regex": "(ab"}, "regex"),
    ("/v1/chat/completions", {"messages": MESSAGES, "regex": "a+", "ebnf": 'root ::= "a"'}, "ebnf"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_object"}, "min_tokens": 2},
     "min_tokens"),
    ("/v1/completions", {"prompt": "x", "ebnf": "root ::= undefined_rule"}, "ebnf"),
    ("/generate", {"text": "x", "sampling_params": {"json_schema": "{not json"}}, "json_schema"),
    ("/generate", {"text": "x", "sampling_params": {"regex": 5}}, "regex"),
])
def test_invalid_grammars_are_400s(c: httpx.Client, route: str, body: dict[str, Any], param: str) -> None:
    if route != "/generate":
        body = {"model": "default", "max_tokens": 4, **body}
    r = c.post(route, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
