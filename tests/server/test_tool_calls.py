"""Tool calls: each format's parser (calls, text around them, malformed calls and unknown names
left as text), a stream cut anywhere carrying what the whole answer carries, the grammars that
force a call; then, on a real server, forced calls (required, named, parallel, streamed) whose
arguments follow their schemas whatever the model, tools and tool messages in the prompt, and
the 400s."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import pytest

from radixserve.grammar import validate_grammar
from radixserve.server.frontend.call_stream import CallStream, whole_calls
from radixserve.server.frontend.tool_calls import PARSERS, StreamedAnswer, parse_tool_calls, tool_grammar
from tests.router.router_helpers import router_in_thread
from tests.server.helpers import ServerProcess

NAMES = {"get_weather", "add"}
CASES = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me check.", [("get_weather", {"city": "Paris"})]),
    ("hermes", '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>\n<tool_call>{"name": "add", '
     '"arguments": "{\\"a\\": 2}"}</tool_call>', "", [("add", {"a": 1}), ("add", {"a": 2})]),
    ("hermes", '<tool_call>{"name": "add", "arguments": {"a": 1}}', "", [("add", {"a": 1})]),  # EOS before the close
    ("hermes", '<tool_call>{"name": "nope", "arguments": {}}</tool_call>', None, []),  # not offered: text
    ("hermes", "<tool_call>{broken json</tool_call>", None, []),
    ("hermes", "No tools needed.  ", None, []),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Oslo"}}', "", [("get_weather", {"city": "Oslo"})]),
    ("llama3", '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "add", "parameters": {"a": 2}}', "",
     [("add", {"a": 1}), ("add", {"a": 2})]),
    ("llama3", "{not a call}", None, []),
    ("llama3", "The answer is 4.", None, []),
    ("mistral", 'Sure. [TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}]', "Sure.", [("add", {"a": 1})]),
    ("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}, {"name": "x", "arguments": {}}]', None, []),
    ("pythonic", '[get_weather(city="Rome"), add(a=1, b=[2, 3])]', "",
     [("get_weather", {"city": "Rome"}), ("add", {"a": 1, "b": [2, 3]})]),
    ("pythonic", "[get_weather(city=some_variable)]", None, []),  # not a literal
    ("pythonic", "[1, 2]", None, []),
]


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_parse(parser: str, text: str, content: str | None, calls: list[tuple[str, dict[str, Any]]]) -> None:
    got_content, got = parse_tool_calls(parser, text, NAMES)
    assert [(c.name, c.arguments) for c in got] == calls
    assert got_content == (text if content is None else content)
    assert len({c.id for c in got}) == len(got) and all(c.id.startswith("call_") for c in got)


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_streamed_answer_carries_the_whole_answer(parser: str, text: str, content: str | None,
                                                  calls: list[tuple[str, dict[str, Any]]]) -> None:
    whole_content, whole_calls = parse_tool_calls(parser, text, NAMES)
    if not whole_calls:
        whole_content = text
    for cut in range(len(text) + 1):
        for cut2 in (cut, min(len(text), cut + 3)):
            s = StreamedAnswer(parser, NAMES)
            parts = [s.feed(text[:cut], False), s.feed(text[cut:cut2], False), s.feed(text[cut2:], True)]
            assert "".join(p[0] for p in parts) == whole_content, (cut, cut2)
            assert [(c.name, c.arguments) for p in parts for c in p[1]] == calls


def test_a_call_is_not_streamed_as_text() -> None:
    s = StreamedAnswer("hermes", NAMES)
    assert s.feed("Let me check. <tool", False) == ("Let me check.", [])  # the marker may be starting
    assert s.feed('_call>{"name": "add", "arguments": {}}', False) == ("", [])
    text, calls = s.feed("</tool_call>", True)
    assert text == "" and [c.name for c in calls] == ["add"]


FORCED = [  # answers a grammar forced, per format
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Par\\u00eds \\ud83d\\ude00",  "n": 1.50,'
     ' "days":[1,2e2,true,null], "o":{"k":"\\"q\\"\\n"}}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": '
     '"{\\"a\\": 1}"}\n</tool_call>\n',
     [("get_weather", {"city": "París 😀", "n": 1.5, "days": [1, 200.0, True, None], "o": {"k": '"q"\n'}}),
      ("add", {"a": 1})]),
    ("llama3", '{"name": "add", "parameters": {"a": -3, "b": 0}}; {"name": "get_weather", "parameters": {}}',
     [("add", {"a": -3, "b": 0}), ("get_weather", {})]),
    ("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": {"q": [1, {"z": "é"}]}}]', [("add", {"q": [1, {"z": "é"}]})]),
]


@pytest.mark.parametrize("parser, text, calls", FORCED)
def test_forced_calls_stream_in_pieces_that_add_up_to_the_whole(parser: str, text: str,
                                                               calls: list[tuple[str, dict[str, Any]]]) -> None:
    """A forced answer read whole gives each call's arguments as ``json.dumps`` writes them; cut at
    any two points, the same calls, each opening with its id and name (empty arguments before)."""
    whole = whole_calls(CallStream(parser).feed(text, final=True))
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole] == [(n, json.dumps(a)) for n, a in calls]
    assert len({c["id"] for c in whole}) == len(calls)
    for cut in range(len(text) + 1):
        for cut2 in (cut, min(len(text), cut + 7)):
            s = CallStream(parser)
            pieces = [*s.feed(text[:cut]), *s.feed(text[cut:cut2]), *s.feed(text[cut2:], final=True)]
            got = whole_calls(pieces)
            assert [c["function"] for c in got] == [c["function"] for c in whole], (cut, cut2)
            assert [p.index for p in pieces if p.id is not None] == list(range(len(calls)))
    # cut short: the last call's arguments as far as they were written
    cut = whole_calls(CallStream(parser).feed(text[: text.index(json.dumps(calls[0][0])) + 40], final=True))
    assert cut[0]["function"]["name"] == calls[0][0] and json.dumps(calls[0][1]).startswith(cut[0]["function"]["arguments"])


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 12},
                                          "unit": {"enum": ["celsius", "fahrenheit"]}},
                                          "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"], "additionalProperties": False}}},
]


@pytest.mark.parametrize("parser", [p for p in PARSERS if p != "pythonic"])
@pytest.mark.parametrize("parallel", [True, False])
def test_tool_grammars_compile(parser: str, parallel: bool) -> None:
    assert validate_grammar("ebnf", tool_grammar(parser, TOOLS, parallel)) is None
    with pytest.raises(ValueError, match="pythonic"):
        tool_grammar("pythonic", TOOLS, parallel)


# --- the shared server (no --tool-call-parser) ---------------------------------------------------
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture
def c(shared_server: ServerProcess) -> Iterator[httpx.Client]:
    with shared_server.client() as client:
        yield client


def _chat(c: httpx.Client, **kw: Any) -> dict[str, Any]:
    r = c.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 80, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _check_calls(calls: list[dict[str, Any]], names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_") and call["function"]["name"] in names
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])


@pytest.mark.slow
def test_forced_calls_follow_their_schemas(c: httpx.Client) -> None:
    named = {"type": "function", "function": {"name": "add"}}
    asks = [  # sent together (one batch): two sampled, not only greedy (the grammar holds whatever
        # is drawn), one with parallel calls, one naming its function
        {"tool_choice": "required", "temperature": 1.0, "seed": 0, "parallel_tool_calls": False},
        {"tool_choice": "required", "temperature": 1.0, "seed": 1, "parallel_tool_calls": False},
        {"tool_choice": "required", "max_tokens": 80},
        {"tool_choice": named, "parallel_tool_calls": False},
    ]
    with ThreadPoolExecutor(len(asks)) as pool:
        outs = [f.result()["choices"][0] for f in [pool.submit(_chat, c, tools=TOOLS, **a) for a in asks]]
    for out in outs[:2]:
        assert out["finish_reason"] == "tool_calls" and out["message"]["content"] is None
        _check_calls(out["message"]["tool_calls"], set(SCHEMAS))
    # parallel calls: this model rarely stops calling, so the answer may be cut by max_tokens: the
    # finish reason says so, and the last call has its arguments as far as they were written
    cut = outs[2]["finish_reason"] == "length"
    assert outs[2]["finish_reason"] in ("tool_calls", "length")
    _check_calls(outs[2]["message"]["tool_calls"][: -1 if cut else None] or outs[2]["message"]["tool_calls"][:1],
                 set(SCHEMAS))
    assert len(outs[3]["message"]["tool_calls"]) == 1
    _check_calls(outs[3]["message"]["tool_calls"], {"add"})
    # streamed: the same call (greedy): its id and name first, its arguments in pieces, then the finish
    want = _chat(c, tools=TOOLS, tool_choice=named, parallel_tool_calls=False)["choices"][0]["message"]["tool_calls"]
    deltas, finish = [], None
    with c.stream("POST", "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 80, "temperature": 0,
                                                        "tools": TOOLS, "tool_choice": named, "stream": True,
                                                        "parallel_tool_calls": False}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for ch in json.loads(line[6:])["choices"]:
                    deltas.append(ch["delta"])
                    finish = ch["finish_reason"] or finish
    got = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert got[0]["id"].startswith("call_") and got[0]["function"]["name"] == "add" and got[0]["index"] == 0
    assert all("id" not in tc and "name" not in tc["function"] and tc["index"] == 0 for tc in got[1:])
    assert len(got) > 2  # the arguments came in pieces
    assert "".join(tc["function"]["arguments"] for tc in got) == want[0]["function"]["arguments"]
    assert finish == "tool_calls" and not "".join(d.get("content", "") for d in deltas)


@pytest.mark.slow
def test_tools_and_tool_messages_reach_the_prompt(c: httpx.Client) -> None:
    plain = _chat(c, max_tokens=1)["usage"]["prompt_tokens"]
    # tool_choice none: the tools are not shown; auto needs the server's parser
    assert _chat(c, max_tokens=1, tools=TOOLS, tool_choice="none")["usage"]["prompt_tokens"] == plain
    history = [*MESSAGES,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    out = _chat(c, messages=history, max_tokens=1, tools=TOOLS, tool_choice="required")
    assert out["usage"]["prompt_tokens"] > plain


@pytest.mark.slow
@pytest.mark.parametrize("kw, param, code", [
    ({"tools": TOOLS}, "tool_choice", "unsupported"),  # auto: this server has no --tool-call-parser
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "unsupported"),
    ({"tool_choice": "required"}, "tool_choice", "invalid_value"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "invalid_value"),
    ({"tools": [{"type": "function", "function": {}}], "tool_choice": "required"}, "tools[0]", "invalid_value"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "invalid_value"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "invalid_value"),
    ({"parallel_tool_calls": True}, "parallel_tool_calls", "invalid_value"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "missing_required_parameter"),
    ({"messages": [*MESSAGES, {"role": "tool", "content": "21"}]}, "messages[1].tool_call_id",
     "missing_required_parameter"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls", "invalid_value"),
])
def test_bad_tool_requests_are_400s(c: httpx.Client, kw: dict[str, Any], param: str, code: str) -> None:
    r = c.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, **kw})
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["param"], r.json()["error"]["code"]) == (param, code)


@pytest.mark.slow
@pytest.mark.parametrize("via", ["server", "router"])
def test_an_agent_loop_with_the_openai_client(shared_server: ServerProcess, via: str) -> None:
    """Ask, get a (forced) call, run the tool, send its result back, get an answer: the round trip
    an agent framework makes, through the official client's types, at the server and through the
    router in front of it (which also streams the call as the server does)."""
    if via == "router":
        with router_in_thread([shared_server.url], policy="cache_aware") as fleet:
            _agent_loop(fleet.url, streamed=True)
    else:
        _agent_loop(shared_server.url)


def _agent_loop(base: str, streamed: bool = False) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
    messages: list[Any] = list(MESSAGES)
    first = client.chat.completions.create(model="default", messages=messages, tools=TOOLS,  # type: ignore[arg-type]
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           parallel_tool_calls=False, max_tokens=80, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.type == "function"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS["get_weather"])
    if streamed:
        chunks = list(client.chat.completions.create(
            model="default", messages=messages, tools=TOOLS,  # type: ignore[arg-type]
            tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=False,
            max_tokens=80, temperature=0, stream=True))
        pieces = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
        assert pieces[0].function and pieces[0].function.name == "get_weather" and len(pieces) > 2
        assert "".join(p.function.arguments or "" for p in pieces if p.function) == call.function.arguments
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"city": args["city"], "temp": 21})}]
    second = client.chat.completions.create(model="default", messages=messages, tools=TOOLS,  # type: ignore[arg-type]
                                            tool_choice="none", max_tokens=8, temperature=0)
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls
    # the call and its result are in the prompt (this model's template has no tool_calls: the
    # call is written into the assistant turn in the hermes format)
    with httpx.Client(base_url=base, timeout=60) as c:
        tokens = c.post("/tokenize", json={"messages": messages}).json()["tokens"]
        prompt = c.post("/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert f'"name": "get_weather", "arguments": {json.dumps(args)}' in prompt and '"temp": 21' in prompt
    assert second.usage is not None and second.usage.prompt_tokens == len(tokens)
