"""The Responses API: input items become the chat the model sees (checked against chat completions
token for token), answers come back as output items, stored responses continue a conversation,
streams carry OpenAI's typed events, the OpenAI SDK reads it all; then the 400s and 404s. The
translation alone first, then a real server."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from radixserve.router.router import Router
from radixserve.server.frontend.protocol import APIError
from radixserve.server.frontend.responses_api import ResponseStore
from radixserve.server.frontend.responses_protocol import ResponsesRequest, chat_body, input_messages
from tests.server.helpers import ServerProcess

ADD = {"type": "function", "name": "add", "description": "Add two integers",
       "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                      "required": ["a", "b"], "additionalProperties": False}}


def test_input_items_become_chat_messages() -> None:
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "What is "}, {"type": "input_text", "text": "2+3?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 2, "b": 3}'},
        {"type": "function_call", "call_id": "call_2", "name": "add", "arguments": '{"a": 0, "b": 0}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "5"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "It is 5."}]},
    ]
    assert input_messages(items) == [
        {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}},
            {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": '{"a": 0, "b": 0}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
        {"role": "assistant", "content": "It is 5."},
    ]
    assert input_messages("hi") == [{"role": "user", "content": "hi"}]


def test_request_fields_become_their_chat_forms() -> None:
    body = ResponsesRequest.model_validate({
        "input": "hi", "instructions": "Be brief.", "max_output_tokens": 9, "tools": [ADD],
        "tool_choice": {"type": "function", "name": "add"}, "top_logprobs": 2, "seed": 4,
        "text": {"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}, "strict": True}},
    })
    chat = chat_body(body, [{"role": "user", "content": "before"}, {"role": "assistant", "content": "ok"}])
    assert chat["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "before"},
                                {"role": "assistant", "content": "ok"}, {"role": "user", "content": "hi"}]
    assert chat["max_completion_tokens"] == 9 and chat["seed"] == 4
    assert chat["logprobs"] is True and chat["top_logprobs"] == 2  # top_logprobs asks for logprobs
    assert chat["tools"] == [{"type": "function", "function": {k: v for k, v in ADD.items() if k != "type"}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "add"}}
    assert chat["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "out", "schema": {"type": "object"}, "strict": True}}


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"type": "input_image", "image_url": "u"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "function_call", "name": "add", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format"),
    ({"input": "x", "text": {"verbosity": "low"}}, "text.verbosity"),
    ({"input": "x", "reasoning": {"summary": "detailed"}}, "reasoning.summary"),
    ({"input": "x", "tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"input": []}, "input"),
])
def test_what_cannot_be_honoured_is_refused(body: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as e:
        chat_body(ResponsesRequest.model_validate(body), [])
    assert e.value.param == param and e.value.status_code == 400


def test_the_store_keeps_the_newest() -> None:
    store = ResponseStore(size=2)
    for i in range(3):
        store.put({"id": f"resp_{i}"}, [], [])
    assert [k for k in store.items] == ["resp_1", "resp_2"]
    with pytest.raises(APIError) as e:
        store.get("resp_0", "previous_response_id")
    assert e.value.status_code == 404 and e.value.param == "previous_response_id"


def test_the_router_routes_a_response_by_its_conversation() -> None:
    r = Router.__new__(Router)
    r.tokenizer = None
    key = r.route_request("/v1/responses", {"instructions": "Be brief.", "input": "Tell me a story"})
    assert key.text == "system: Be brief.\nuser: Tell me a story\n"


# --- a real server ---------------------------------------------------------------------------------
@pytest.fixture
def c(shared_server: ServerProcess) -> Iterator[httpx.Client]:
    with shared_server.client() as client:
        yield client


def _respond(c: httpx.Client, **kw: Any) -> dict[str, Any]:
    r = c.post("/v1/responses", json={"max_output_tokens": 12, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _chat(c: httpx.Client, messages: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
    r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 12, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _text(resp: dict[str, Any]) -> str:
    return "".join(p["text"] for it in resp["output"] if it["type"] == "message" for p in it["content"])


@pytest.mark.slow
def test_a_response_is_the_chat_completion_of_its_messages(c: httpx.Client) -> None:
    resp = _respond(c, input="Name a colour.", instructions="Answer in one word.")
    chat = _chat(c, [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a colour."}])
    assert resp["object"] == "response" and resp["id"].startswith("resp_") and resp["store"] is True
    assert _text(resp) == chat["choices"][0]["message"]["content"]
    assert resp["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert resp["usage"]["output_tokens"] == chat["usage"]["completion_tokens"]
    want = "incomplete" if chat["choices"][0]["finish_reason"] == "length" else "completed"
    assert resp["status"] == want and resp["output"][-1]["status"] == want
    assert (resp["incomplete_details"] is not None) == (want == "incomplete")


@pytest.mark.slow
def test_stored_responses_continue_retrieve_and_delete(c: httpx.Client) -> None:
    first = _respond(c, input="Say hello.", instructions="Be brief.")
    assert c.get(f"/v1/responses/{first['id']}").json() == first
    second = _respond(c, input="Again.", previous_response_id=first["id"])
    # the conversation so far comes first; the instructions do not carry over
    chat = _chat(c, [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": _text(first)},
                     {"role": "user", "content": "Again."}])
    assert second["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert _text(second) == chat["choices"][0]["message"]["content"]
    assert second["previous_response_id"] == first["id"]
    # its input items: this request's only (not the conversation before), newest first, in pages
    items = c.get(f"/v1/responses/{second['id']}/input_items").json()
    assert [(it["type"], it["role"], it["content"]) for it in items["data"]] == [
        ("message", "user", [{"type": "input_text", "text": "Again."}])]
    listed = _respond(c, input=[{"role": "user", "content": "One."}, {"role": "assistant", "content": "Two."},
                                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "3"}]}],
                      max_output_tokens=1)
    page = c.get(f"/v1/responses/{listed['id']}/input_items", params={"limit": 2, "order": "asc"}).json()
    assert [it["role"] for it in page["data"]] == ["user", "assistant"] and page["has_more"]
    assert page["data"][1]["content"] == [{"type": "output_text", "text": "Two."}]
    rest = c.get(f"/v1/responses/{listed['id']}/input_items",
                 params={"order": "asc", "after": page["last_id"]}).json()
    assert [it["content"][0]["text"] for it in rest["data"]] == ["3"] and not rest["has_more"]
    assert c.get(f"/v1/responses/{listed['id']}/input_items", params={"order": "up"}).status_code == 400
    assert c.get("/v1/responses/resp_none/input_items").status_code == 404
    assert c.delete(f"/v1/responses/{first['id']}").json() == {"id": first["id"], "object": "response.deleted",
                                                               "deleted": True}
    for r in (c.get(f"/v1/responses/{first['id']}"), c.post("/v1/responses", json={
            "input": "x", "previous_response_id": first["id"]})):
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    unstored = _respond(c, input="Hi.", store=False)
    assert c.get(f"/v1/responses/{unstored['id']}").status_code == 404


@pytest.mark.slow
def test_a_forced_call_and_its_output_round_trip(c: httpx.Client) -> None:
    ask = {"input": "Add 2 and 3.", "tools": [ADD], "tool_choice": {"type": "function", "name": "add"},
           "max_output_tokens": 60, "parallel_tool_calls": False}
    resp = _respond(c, **ask)
    calls = [it for it in resp["output"] if it["type"] == "function_call"]
    assert len(calls) == 1 and calls[0]["name"] == "add" and calls[0]["call_id"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), ADD["parameters"])
    # streamed: the call's item opens with its name, its arguments come in pieces
    with c.stream("POST", "/v1/responses", json={**ask, "temperature": 0, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [(e["item"]["type"], e["item"]["name"], e["item"]["arguments"]) for e in added] == [("function_call", "add", "")]
    pieces = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert len(pieces) > 1 and "".join(pieces) == calls[0]["arguments"]
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [e["arguments"] for e in done] == [calls[0]["arguments"]] and events[-1]["type"] == "response.completed"
    follow = [{"role": "user", "content": "Add 2 and 3."},
              {"type": "function_call", "call_id": calls[0]["call_id"], "name": "add", "arguments": calls[0]["arguments"]},
              {"type": "function_call_output", "call_id": calls[0]["call_id"], "output": "5"}]
    got = _respond(c, input=follow, tools=[ADD], tool_choice="none")
    chat = _chat(c, [{"role": "user", "content": "Add 2 and 3."},
                     {"role": "assistant", "content": None, "tool_calls": [{"id": calls[0]["call_id"], "type": "function",
                      "function": {"name": "add", "arguments": calls[0]["arguments"]}}]},
                     {"role": "tool", "tool_call_id": calls[0]["call_id"], "content": "5"}],
                 tools=[{"type": "function", "function": {k: v for k, v in ADD.items() if k != "type"}}], tool_choice="none")
    assert got["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert _text(got) == chat["choices"][0]["message"]["content"]


@pytest.mark.slow
def test_text_format_json_schema(c: httpx.Client) -> None:
    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 10}}, "required": ["colour"],
              "additionalProperties": False}
    resp = _respond(c, input="A colour as JSON.", max_output_tokens=40,
                    text={"format": {"type": "json_schema", "name": "colour", "schema": schema}})
    assert resp["status"] == "completed"
    jsonschema.validate(json.loads(_text(resp)), schema)


@pytest.mark.slow
def test_a_stream_carries_the_same_answer_as_typed_events(c: httpx.Client) -> None:
    whole = _respond(c, input="Name a fruit.", include=["message.output_text.logprobs"])
    events: list[tuple[str, dict[str, Any]]] = []
    with c.stream("POST", "/v1/responses", json={"input": "Name a fruit.", "max_output_tokens": 12, "temperature": 0,
                                                  "stream": True, "include": ["message.output_text.logprobs"]}) as r:
        assert r.status_code == 200
        kind = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == kind
                events.append((kind, data))
    kinds = [k for k, _ in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if whole["status"] == "completed" else "response.incomplete"]
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    deltas = [d for k, d in events if k == "response.output_text.delta"]
    text = "".join(d["delta"] for d in deltas)
    assert text == _text(whole) == events[-4][1]["text"]
    final = events[-1][1]["response"]
    assert _text(final) == text and final["usage"]["output_tokens"] == whole["usage"]["output_tokens"]
    lps = whole["output"][0]["content"][0]["logprobs"]
    # each delta carries its tokens' logprobs; the done event all of them (a last token with no
    # text, the end of turn, is in no delta)
    streamed = [x["token"] for d in deltas for x in d["logprobs"]]
    assert [x["token"] for x in events[-4][1]["logprobs"]] == [x["token"] for x in lps]
    assert streamed == [x["token"] for x in lps][: len(streamed)] and len(streamed) >= len(lps) - 1
    assert c.get(f"/v1/responses/{final['id']}").json()["output"] == final["output"]  # stored when it ended


@pytest.mark.slow
def test_the_openai_sdk_reads_it(shared_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{shared_server.url}/v1", api_key="none", max_retries=0)
    resp = client.responses.create(model="default", input="Name an animal.", max_output_tokens=10, temperature=0)
    assert resp.output_text and resp.usage is not None and resp.usage.output_tokens > 0
    later = client.responses.create(model="default", input="Another.", previous_response_id=resp.id,
                                    max_output_tokens=10, temperature=0)
    assert later.previous_response_id == resp.id
    events = list(client.responses.create(model="default", input="Name an animal.", max_output_tokens=10,
                                          temperature=0, stream=True))
    done = events[-1]
    assert done.type in ("response.completed", "response.incomplete") and done.response.status == resp.status
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == resp.output_text
    assert done.response.output_text == resp.output_text
    # a function tool (forced), whole and streamed
    kw: dict[str, Any] = dict(model="default", input="Add 2 and 3.", tools=[ADD], max_output_tokens=60,
                              tool_choice={"type": "function", "name": "add"}, parallel_tool_calls=False, temperature=0)
    called = client.responses.create(**kw)
    calls = [it for it in called.output if it.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "add"
    jsonschema.validate(json.loads(calls[0].arguments), ADD["parameters"])
    streamed = list(client.responses.create(**kw, stream=True))
    assert "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta") == calls[0].arguments


@pytest.mark.slow
@pytest.mark.parametrize("body, status, param", [
    ({"input": "x", "nope": 1}, 400, "nope"),
    ({"input": "x", "background": True}, 400, "background"),
    ({"input": "x", "include": ["file_search_call.results"]}, 400, "include[0]"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
    ({"input": "x", "previous_response_id": "resp_missing"}, 404, "previous_response_id"),
    ({"input": "x", "reasoning": {"effort": "low"}}, 400, "reasoning.effort"),  # no --reasoning-parser here
    ({"input": "x", "model": "other"}, 404, "model"),
])
def test_refusals(c: httpx.Client, body: dict[str, Any], status: int, param: str) -> None:
    r = c.post("/v1/responses", json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
