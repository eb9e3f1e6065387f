"""``--reasoning-parser``: the splitter on whole outputs and on every way of cutting one into
stream deltas; then a real server running the deepseek-r1 parser (the bundled model writes no
``</think>``, so its whole answer is reasoning), streamed and not, with template variables."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from radixserve.server.frontend.reasoning import FORMATS, ReasoningSplitter, after_reasoning, split_reasoning
from radixserve.server.frontend.tool_calls import tool_grammar
from tests.server.helpers import ServerProcess

QWEN3, R1 = FORMATS["qwen3"], FORMATS["deepseek-r1"]

CASES = [
    # format, output, (reasoning, content)
    (QWEN3, "<think>\nLet me see.\n</think>\n\nParis.", ("\nLet me see.\n", "Paris.")),
    (QWEN3, "Paris.", ("", "Paris.")),  # thinking off: no opening marker, all content
    (QWEN3, "<thin", ("", "<thin")),  # a marker that never completed is text
    (QWEN3, "<think>still thinking", ("still thinking", "")),
    (QWEN3, "<think></think>", ("", "")),
    (QWEN3, "<think>a </thi b</think>c </think> d", ("a </thi b", "c </think> d")),
    (R1, "Let me see.</think>\n\nParis.", ("Let me see.", "Paris.")),
    (R1, "<think>Let me see.</think>Paris.", ("Let me see.", "Paris.")),  # a repeated opener is dropped
    (R1, "no end marker at all", ("no end marker at all", "")),
    (R1, "x</think>\n\n\n", ("x", "")),
    (R1, "x</think>\n\nline one\n\nline two", ("x", "line one\n\nline two")),
]


@pytest.mark.parametrize("fmt, text, want", CASES)
def test_split_whole_outputs(fmt: Any, text: str, want: tuple[str, str]) -> None:
    assert split_reasoning(fmt, text) == want


@pytest.mark.parametrize("fmt, text, want", CASES)
def test_every_stream_cut_splits_as_the_whole(fmt: Any, text: str, want: tuple[str, str]) -> None:
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            s = ReasoningSplitter(fmt)
            parts = [s.feed(text[:i]), s.feed(text[i:j]), s.feed(text[j:], final=True)]
            assert ("".join(p[0] for p in parts), "".join(p[1] for p in parts)) == want, (i, j)


def test_nothing_is_emitted_before_it_is_certain() -> None:
    s = ReasoningSplitter(QWEN3)
    assert s.feed("<th") == ("", "")  # may still open the reasoning part
    assert s.feed("ink>ab</th") == ("ab", "")  # "</th" may still close it
    assert s.feed("ink>\n") == ("", "")  # the newlines after the marker are not content
    assert s.feed("\nOK", final=True) == ("", "OK")


# --- a grammar after the reasoning part ------------------------------------------------------------
@pytest.fixture(scope="module")
def compiler() -> Any:
    from radixserve.grammar import GrammarCompiler
    from radixserve.model.tokenizer import Tokenizer

    tok = Tokenizer.from_model_path(None)
    return tok, GrammarCompiler(tok.backend.to_str, tok.vocab_size, tok.stop_token_ids)


SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": json.loads(SCHEMA)}}]


def _accepts(compiler: Any, grammar: str, text: str) -> bool:
    tok, comp = compiler
    m = comp.submit("ebnf", grammar).result()
    for t in tok.encode(text):
        if not m.consume_token(t) or m.is_error():
            return False
    return bool(m.is_accepting())


@pytest.mark.parametrize("fmt, kind, grammar, good, bad", [
    (QWEN3, "json_schema", SCHEMA, ['<think>\n{"a": 2} </thi </think>\n\n{"a": 1}', '{"a": 1}', "<think></think>{\"a\": 7}"],
     ['<think>x</think>\n\nParis', '<think>x</think> {"a": 1}', 'Paris']),
    (R1, "json_schema", SCHEMA, ['Let me see.</think>\n{"a": 1}', '</think>{"a": 3}'], ['{"a": 1}', 'x</think>{"b": 1}']),
    (R1, "regex", "[0-9]+/x", ["hm</think>\n\n12/x"], ["hm</think>12", "12/x"]),
    (QWEN3, "ebnf", 'root ::= "yes" | "no"', ["<think>ok</think>\nyes", "no"], ["<think>ok</think>maybe"]),
    (R1, "ebnf", tool_grammar("hermes", TOOLS, parallel=False),
     ['I should call f.</think>\n<tool_call>\n{"name": "f", "arguments": {"a": 5}}\n</tool_call>\n'],
     ['x</think>\n<tool_call>\n{"name": "g", "arguments": {"a": 5}}\n</tool_call>\n', "x</think>\nno call"]),
])
def test_grammar_applies_after_the_reasoning_part(compiler: Any, fmt: Any, kind: str, grammar: str,
                                                  good: list[str], bad: list[str]) -> None:
    """The wrapped grammar leaves the thinking free (the end marker may even appear half-written in
    it), drops only newlines between it and the answer, and holds the answer (the content the
    splitter gives) to the request's grammar."""
    wrapped = after_reasoning(fmt, kind, grammar)
    assert all(_accepts(compiler, wrapped, text) for text in good), good
    assert not any(_accepts(compiler, wrapped, text) for text in bad), bad


# --- a real server ---------------------------------------------------------------------------------
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if enable_thinking is defined and not enable_thinking %}(no thinking){% endif %}"
            "{% if reasoning_effort is defined %}(effort {{ reasoning_effort }}){% endif %}"
            "<|im_start|>assistant\n<think>\n")
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    path = tmp_path_factory.mktemp("template") / "r1.jinja"
    path.write_text(TEMPLATE)
    srv = ServerProcess("--reasoning-parser", "deepseek-r1", "--chat-template", str(path))
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.kill()


def _chat(c: httpx.Client, **kw: Any) -> dict[str, Any]:
    r = c.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 12, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


@pytest.mark.slow
def test_server_answers_reasoning_apart(server: ServerProcess) -> None:
    with server.client() as c:
        plain = _chat(c, separate_reasoning=False)["choices"][0]["message"]
        msg = _chat(c)["choices"][0]["message"]
        assert "</think>" not in plain["content"] and plain["content"] and "reasoning_content" not in plain
        assert msg == {"role": "assistant", "content": "", "reasoning_content": plain["content"]}
        # streamed: the same text, in reasoning_content deltas
        deltas: list[dict[str, Any]] = []
        with c.stream("POST", "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 12,
                                                            "temperature": 0, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    deltas += [ch["delta"] for ch in json.loads(line[6:])["choices"]]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == plain["content"]
        assert not "".join(d.get("content", "") for d in deltas)
        # template variables reach the template; the ones the server sets may not be overridden
        base = _chat(c)["usage"]["prompt_tokens"]
        assert _chat(c, chat_template_kwargs={"enable_thinking": False})["usage"]["prompt_tokens"] > base
        assert _chat(c, reasoning_effort="low")["usage"]["prompt_tokens"] > base
        r = c.post("/v1/chat/completions", json={"messages": MESSAGES, "chat_template_kwargs": {"messages": []}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
        # a grammar (structured output, a forced call) holds the answer after the thinking, not the
        # thinking: this model never closes it, so the answer is the same reasoning (which may not end
        # before the answer: EOS is masked), cut by max_tokens
        for kw in ({"response_format": {"type": "json_object"}},
                   {"tools": TOOLS, "tool_choice": "required"}):
            out = _chat(c, **kw)["choices"][0]
            assert out["message"]["reasoning_content"].startswith(plain["content"]) and not out["message"]["content"]
            assert out["finish_reason"] == "length" and "tool_calls" not in out["message"]
        bad = c.post("/v1/chat/completions", json={"messages": MESSAGES, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format"
        assert _chat(c, response_format={"type": "json_object"}, separate_reasoning=False, max_tokens=4)


@pytest.mark.slow
def test_responses_carry_the_reasoning_as_its_own_item(server: ServerProcess) -> None:
    with server.client() as c:
        plain = _chat(c, separate_reasoning=False)["choices"][0]["message"]["content"]
        body = {"input": MESSAGES[0]["content"], "max_output_tokens": 12, "temperature": 0}
        resp = c.post("/v1/responses", json=body).json()
        assert [it["type"] for it in resp["output"]] == ["reasoning"]  # cut inside the thinking
        assert resp["output"][0]["content"] == [{"type": "reasoning_text", "text": plain}]
        assert 0 < resp["usage"]["output_tokens_details"]["reasoning_tokens"] <= resp["usage"]["output_tokens"]
        events = []
        with c.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
        assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == plain
        assert [it["type"] for it in events[-1]["response"]["output"]] == ["reasoning"]
        effort = c.post("/v1/responses", json={**body, "reasoning": {"effort": "low"}}).json()
        assert effort["usage"]["input_tokens"] > resp["usage"]["input_tokens"]  # the template shows it


def test_reasoning_parser_option() -> None:
    from radixserve.config import ServerArgs

    assert ServerArgs().reasoning_parser is None
    assert ServerArgs(reasoning_parser="qwen3").reasoning_parser == "qwen3"
    with pytest.raises(ValueError, match="reasoning_parser must be one of qwen3, deepseek-r1"):
        ServerArgs(reasoning_parser="r2")
