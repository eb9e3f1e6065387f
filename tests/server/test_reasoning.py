"""``--reasoning-parser``: the splitter on whole outputs and on every way of cutting one into
stream deltas; then a real server running the deepseek-r1 parser (the bundled model writes no
``</think>``, so its whole answer is reasoning), streamed and not, with template variables."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from radixserve.server.frontend.reasoning import FORMATS, ReasoningSplitter, split_reasoning
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
        # a grammar would constrain the thinking: refused, unless the request turns the parser off
        fmt = {"type": "json_object"}
        r = c.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4, "response_format": fmt})
        assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported"
        _chat(c, response_format=fmt, separate_reasoning=False, max_tokens=4)


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
