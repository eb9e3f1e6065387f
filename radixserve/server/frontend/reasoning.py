"""Reasoning output (``--reasoning-parser``): what a reasoning model writes between its think
markers is answered as ``reasoning_content``, the rest as ``content``, in chat completions and in
their stream deltas.

Two formats, named as SGLang and vLLM name them:

- ``qwen3``: the output opens the reasoning part itself (``<think>`` first); an output that does
  not start with the marker has no reasoning part (Qwen3 with ``enable_thinking`` off);
- ``deepseek-r1``: the chat template already opened the reasoning part in the prompt, so the
  output starts inside it (a leading ``<think>`` is dropped); without ``</think>`` all of it is
  reasoning.

``ReasoningSplitter`` works on text deltas: a marker split across deltas is held back until it
completes or can no longer, so streamed and whole answers split the same way. The newlines a model
writes between ``</think>`` and its answer are not part of the content.

A grammar (structured output, a forced tool call) constrains the content only: ``after_reasoning``
wraps it in one that first lets the model think freely up to the end marker.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningFormat:
    start: str
    end: str
    starts_inside: bool  # the prompt opened the reasoning part


FORMATS = {
    "qwen3": ReasoningFormat("<think>", "</think>", starts_inside=False),
    "deepseek-r1": ReasoningFormat("<think>", "</think>", starts_inside=True),
}


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ReasoningSplitter:
    def __init__(self, fmt: ReasoningFormat) -> None:
        self.fmt = fmt
        self.state = "start"  # start -> reasoning -> after (newlines dropped) -> content
        self.buf = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """``(reasoning, content)`` that ``text`` (the next delta) makes certain; ``final``: the
        output ended, flush what was held back."""
        self.buf += text
        reasoning, content = "", ""
        while True:
            if self.state == "start":
                start = self.fmt.start
                if self.buf.startswith(start):
                    self.buf = self.buf[len(start):]
                    self.state = "reasoning"
                elif start.startswith(self.buf) and not final:
                    break  # could still become the opening marker
                else:
                    self.state = "reasoning" if self.fmt.starts_inside else "content"
            elif self.state == "reasoning":
                i = self.buf.find(self.fmt.end)
                if i >= 0:
                    reasoning += self.buf[:i]
                    self.buf = self.buf[i + len(self.fmt.end):]
                    self.state = "after"
                    continue
                keep = 0 if final else _partial_suffix(self.buf, self.fmt.end)
                reasoning += self.buf[: len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep:]
                break
            elif self.state == "after":
                self.buf = self.buf.lstrip("\n")
                if not self.buf:
                    break
                self.state = "content"
            else:
                content += self.buf
                self.buf = ""
                break
        return reasoning, content


def split_reasoning(fmt: ReasoningFormat, text: str) -> tuple[str, str]:
    """A whole output's ``(reasoning, content)``."""
    return ReasoningSplitter(fmt).feed(text, final=True)


def after_reasoning(fmt: ReasoningFormat, kind: str, text: str) -> str:
    """A Lark grammar (llguidance) for: the reasoning part as ``fmt`` writes it (any text up to the
    end marker, which llguidance's ``stop`` takes; optional where the output opens it itself), the
    newlines the splitter drops, then a sentence of the request's grammar (``kind``: json_schema,
    regex or ebnf, already validated), which is therefore exactly the answer's content."""
    import llguidance

    if kind == "json_schema":
        body = f"%json {json.dumps(json.loads(text))}"  # (one line)
    elif kind == "regex":
        body = f"/{llguidance.regex_to_lark(text)}/"
    else:
        body = "%lark {\n" + llguidance.grammar_from("gbnf", text) + "\n}"  # GBNF or Lark, as Lark
    think = "think SEP?" if fmt.starts_inside else f"({json.dumps(fmt.start)} think SEP?)?"
    return (f"start: {think} body\nthink[stop={json.dumps(fmt.end)}]: /(?s:.*)/\nSEP: /\\n+/\n"
            f"body: {body}\n")
