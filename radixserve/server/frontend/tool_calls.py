"""Tool calls in chat completions: the formats models write them in, parsed out of the answer,
and the grammar that makes the model write one when the request requires it.

Formats (``--tool-call-parser``, SGLang's and vLLM's names):

- ``hermes`` (Qwen 2.5 / 3, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one block per call, text around them;
- ``llama3``: the answer is a JSON object ``{"name": ..., "parameters": {...}}`` (after an
  optional ``<|python_tag|>``), several separated by ``;``;
- ``mistral``: ``[TOOL_CALLS]`` then a JSON array of ``{"name": ..., "arguments": {...}}``;
- ``pythonic`` (Llama 3.2/4): the answer is a Python list of calls, ``[f(a=1), g(b="x")]``.

A call that does not parse, or names a function the request did not offer, stays text: never a
500. With calls, the content is the text around them, without its trailing whitespace (None when
nothing is left). ``tool_choice`` ``required`` or a named function is enforced by a grammar (llguidance Lark
with the tools' JSON schemas inside) in the format of the server's parser (``hermes`` when the
server has none): the answer is then one or more calls whose arguments follow their schema,
whatever the model.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

PARSERS = ("hermes", "llama3", "mistral", "pythonic")
_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
# where a call may begin, per format: streamed text is held back from here on
_STARTS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = f"call_{uuid.uuid4().hex[:24]}"

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": json.dumps(self.arguments)}}
        if index is not None:
            out["index"] = index
        return out


def _call(obj: Any, names: set[str], args_key: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args: Any = next((obj[k] for k in args_key if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return ToolCall(obj["name"], args) if isinstance(args, dict) else None


def parse_tool_calls(parser: str, text: str, names: set[str]) -> tuple[str, list[ToolCall]]:
    """``(content, calls)`` of a whole answer; with no call, ``(text, [])``."""
    if parser == "hermes":
        calls, kept = [], []
        last = 0
        for m in _HERMES_BLOCK.finditer(text):
            try:
                call = _call(json.loads(m.group(1)), names)
            except ValueError:
                call = None
            if call is None:
                continue
            calls.append(call)
            kept.append(text[last : m.start()])
            last = m.end()
        if not calls:
            return text, []
        kept.append(text[last:])
        return "".join(kept).rstrip(), calls
    if parser == "mistral":
        head, marker, rest = text.partition("[TOOL_CALLS]")
        if not marker:
            return text, []
        try:
            items = json.loads(rest.strip())
        except ValueError:
            return text, []
        items = items if isinstance(items, list) else [items]
        parsed = [_call(x, names) for x in items]
        if not parsed or any(c is None for c in parsed):
            return text, []
        return head.rstrip(), [c for c in parsed if c is not None]
    if parser == "llama3":
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        try:
            parsed = [_call(json.loads(part), names) for part in _split_json_objects(body)]
        except ValueError:
            return text, []
        if not parsed or any(c is None for c in parsed):
            return text, []
        return "", [c for c in parsed if c is not None]
    if parser == "pythonic":
        return _parse_pythonic(text, names)
    raise ValueError(f"unknown tool-call parser {parser!r}; one of {', '.join(PARSERS)}")


def _split_json_objects(body: str) -> list[str]:
    """``{..}; {..}`` -> the objects (each must parse as a whole: ValueError otherwise)."""
    decoder, out, i = json.JSONDecoder(), [], 0
    while i < len(body):
        _, end = decoder.raw_decode(body, i)
        out.append(body[i:end])
        i = end
        while i < len(body) and body[i] in " \n\t;":
            i += 1
    return out


def _parse_pythonic(text: str, names: set[str]) -> tuple[str, list[ToolCall]]:
    body = text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>").strip()
    if not (body.startswith("[") and body.endswith("]")):
        return text, []
    try:
        tree = ast.parse(body, mode="eval").body
    except SyntaxError:
        return text, []
    if not isinstance(tree, ast.List) or not tree.elts:
        return text, []
    calls = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
                and node.func.id in names and all(k.arg for k in node.keywords)):
            return text, []
        try:
            args = {str(k.arg): ast.literal_eval(k.value) for k in node.keywords}
        except ValueError:
            return text, []
        calls.append(ToolCall(node.func.id, args))
    return "", calls


def may_start_call(parser: str, text: str) -> int | None:
    """Where in ``text`` (an answer so far) a call may begin, so a stream holds it back from there;
    None: nothing yet (text is safe to send)."""
    marker = _STARTS.get(parser)
    if marker is not None:
        i = text.find(marker)
        if i >= 0:
            return i
        for k in range(min(len(marker) - 1, len(text)), 0, -1):  # the marker cut at the end
            if text.endswith(marker[:k]):
                return len(text) - k
        return None
    # llama3 and pythonic calls are the whole answer: hold from its first non-space character on
    # when that may open one
    stripped = text.lstrip()
    if not stripped:
        return None
    opener = ("{", "<|python_tag|>") if parser == "llama3" else ("[", "<|python_start|>")
    if any(stripped.startswith(o) or o.startswith(stripped) for o in opener):
        return len(text) - len(stripped)
    return None


class StreamedAnswer:
    """One streamed choice's content while calls may come: the text up to where a call may begin
    goes out as it comes (trailing whitespace waits: a call after it would strip it); at the end
    the answer is parsed whole, so the stream carries what the whole answer would."""

    def __init__(self, parser: str, names: set[str]) -> None:
        self.parser, self.names = parser, names
        self.text = ""
        self.sent = 0

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        """``(content to send, calls)``; calls only at the end."""
        self.text += text
        if final:
            content, calls = parse_tool_calls(self.parser, self.text, self.names)
            if not calls:
                content = self.text
            out = content[self.sent:]  # what was sent is a prefix of the content, by the holding rule
            self.sent = len(self.text)
            return out, calls
        hold = may_start_call(self.parser, self.text)
        end = len(self.text[:hold].rstrip())
        if end <= self.sent:
            return "", []
        out = self.text[self.sent:end]
        self.sent = end
        return out, []


# --- forcing calls ---------------------------------------------------------------------------------
def tool_grammar(parser: str, tools: list[dict[str, Any]], parallel: bool) -> str:
    """A Lark grammar (llguidance) whose every sentence is one call (several if ``parallel``) to one
    of ``tools`` in ``parser``'s format, arguments following the tool's schema."""
    def call_schema(fn: dict[str, Any], args_key: str = "arguments") -> dict[str, Any]:
        params = fn.get("parameters") or {"type": "object"}
        return {"type": "object", "properties": {"name": {"const": fn["name"]}, args_key: params},
                "required": ["name", args_key], "additionalProperties": False}

    fns = [t["function"] for t in tools]
    if parser == "pythonic":
        raise ValueError("tool_choice required / a named function is not supported with the pythonic parser")
    key = "parameters" if parser == "llama3" else "arguments"
    schema = json.dumps({"anyOf": [call_schema(f, key) for f in fns]})
    rep = "+" if parallel else ""
    if parser == "hermes":
        return f'start: call{rep}\ncall: "<tool_call>\\n" obj "\\n</tool_call>\\n"\nobj: %json {schema}\n'
    if parser == "mistral":
        array = json.dumps({"type": "array", "items": {"anyOf": [call_schema(f) for f in fns]}, "minItems": 1,
                            **({} if parallel else {"maxItems": 1})})
        return f'start: "[TOOL_CALLS]" arr\narr: %json {array}\n'
    if parser == "llama3":
        more = '(";" obj)*' if parallel else ""
        return f"start: obj {more}\nobj: %json {schema}\n"
    raise ValueError(f"unknown tool-call parser {parser!r}")


def inline_tool_calls(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For a chat template that does not render ``tool_calls``: each assistant message's calls
    written into its content in the hermes format, so the model still sees what it called."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if m.get("role") == "assistant" and calls:
            blocks = [json.dumps({"name": (c.get("function") or {}).get("name"),
                                  "arguments": (c.get("function") or {}).get("arguments")}) for c in calls]
            text = "\n".join(f"<tool_call>\n{b}\n</tool_call>" for b in blocks)
            m = {**m, "content": f"{m.get('content') or ''}\n{text}".lstrip("\n")}
            del m["tool_calls"]
        out.append(m)
    return out


def tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    """For a chat template that takes no ``tools``: the tools and the hermes format, as a system
    message (the request is then parsed as hermes)."""
    listing = "\n".join(json.dumps(t["function"]) for t in tools)
    return ("You may call one or more functions to answer. The functions:\n" + listing + "\n"
            'To call one, write <tool_call>{"name": <function name>, "arguments": <arguments object>}'
            "</tool_call>, one block per call.")
