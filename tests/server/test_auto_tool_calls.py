"""``tool_choice: auto`` on a real server with ``--tool-call-parser hermes`` (the keyed test server,
shared with the API-edge and lifecycle tests: this module runs before the lifecycle tests end it)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from tests.server.helpers import API_KEY, ServerProcess
from tests.server.test_tool_calls import MESSAGES, SCHEMAS, TOOLS


@pytest.mark.slow
def test_auto_calls_are_read_out_of_the_answer(keyed_server: ServerProcess) -> None:
    """``tool_choice: auto`` on a server with ``--tool-call-parser hermes``, through the official
    client: the answer's call (written here by a grammar of the request's own, as a model trained on
    the format writes it) is parsed out, the text before it is the content; streamed, the same."""
    import openai

    client = openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    args = json.dumps(SCHEMAS["get_weather"])
    grammar = ('start: "Let me check.\\n<tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": " args '
               f'"}}\\n</tool_call>"\nargs: %json {args}\n')
    kw: dict[str, Any] = dict(model="default", messages=MESSAGES, tools=TOOLS, max_tokens=60, temperature=0,
                              extra_body={"ebnf": grammar})
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Let me check."
    assert whole.message.tool_calls and whole.message.tool_calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(whole.message.tool_calls[0].function.arguments), SCHEMAS["get_weather"])
    chunks = [ch.choices[0] for ch in client.chat.completions.create(**kw, stream=True) if ch.choices]
    assert "".join(ch.delta.content or "" for ch in chunks) == "Let me check."
    calls = [tc for ch in chunks for tc in ch.delta.tool_calls or []]
    assert [(tc.function.name, tc.function.arguments) for tc in calls if tc.function] == [
        (whole.message.tool_calls[0].function.name, whole.message.tool_calls[0].function.arguments)]
    assert chunks[-1].finish_reason == "tool_calls"
    # none: the tools are neither shown nor parsed
    none = client.chat.completions.create(**{**kw, "max_tokens": 9}, tool_choice="none")
    assert none.choices[0].message.tool_calls is None and "<tool_call" in (none.choices[0].message.content or "")
