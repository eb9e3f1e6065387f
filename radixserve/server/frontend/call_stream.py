"""The calls of a grammar-forced answer, read as they are written: each call's id and name as soon
as its name is complete, then its arguments in pieces.

A forced answer (``tool_choice`` required or a named function) is calls and nothing else, in the
parser's format (tool_calls.py): hermes ``<tool_call>{"name": .., "arguments": {..}}</tool_call>``
blocks, llama3 objects with ``parameters`` separated by ``;``, mistral ``[TOOL_CALLS]`` and an array
of objects. ``CallStream`` scans that text character by character as JSON (the grammar makes it
valid): the objects at the call level are calls; their ``name`` string gives the call's first piece;
the value of their arguments key is sent normalized as it goes, token by token, so that the pieces
add up to ``json.dumps`` of the arguments (``", "`` and ``": "`` separators, ASCII escapes, numbers
as Python reads and writes them), the form a whole answer's calls take.

The pieces depend on the text only, never on how it was cut: the whole answer fed at once gives the
same pieces, which is what the non-streamed answer is built from. An answer cut short (``length``)
ends with its last call's arguments as far as they were written, as OpenAI's do.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

_SIMPLE_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_MISTRAL_MARKER = "[TOOL_CALLS]"


@dataclass
class CallPiece:
    index: int  # the call's place in the answer
    arguments: str  # the next piece of its arguments
    id: str | None = None  # with the name, on the call's first piece
    name: str | None = None

    def to_openai(self) -> dict[str, Any]:
        """The piece as a chat chunk's ``delta.tool_calls`` entry."""
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class _Call:
    id: str
    name: str | None = None
    held: list[str] = field(default_factory=list)  # argument pieces written before the name
    string_args: list[str] | None = None  # arguments written as a JSON string: sent whole at its end


class CallStream:
    def __init__(self, parser: str) -> None:
        self.call_depth = 1 if parser == "mistral" else 0  # open containers around a call object
        self.args_keys = ("parameters", "arguments") if parser == "llama3" else ("arguments",)
        self.before = "" if parser == "mistral" else None  # text until the marker, then None
        self.stack: list[str] = []  # "{" / "[" per open container
        self.keys: list[str | None] = []  # per open container: an object's current key
        self.want_key: list[bool] = []  # per open container: an object expects a key next
        self.string: list[str] | None = None  # the open string's decoded characters
        self.string_is_key = False
        self.escape: str | None = None  # an escape sequence being read
        self.atom = ""  # a number or literal being read
        self.region: int | None = None  # stack depth at which the arguments value being sent began
        self.calls: list[_Call] = []
        self.out: list[CallPiece] = []

    # --- public ----------------------------------------------------------------------------------
    def feed(self, text: str, final: bool = False) -> list[CallPiece]:
        """The pieces ``text`` (the answer's next part) completes; ``final``: the answer ended."""
        if self.before is not None:
            self.before += text
            i = self.before.find(_MISTRAL_MARKER)
            if i < 0:
                return []
            text, self.before = self.before[i + len(_MISTRAL_MARKER):], None
        for c in text:
            self._char(c)
        if final:
            if self.atom:
                self._atom_done()
            if self.string is not None and self._in_args() and len(self.stack) == self.region:
                self.calls[-1].string_args = self.string  # cut inside its string arguments
                self._string_args_done(self.calls[-1])
        out, self.out = self.out, []
        return _merge(out)

    # --- the scanner -------------------------------------------------------------------------------
    def _emit(self, piece: str) -> None:
        call = self.calls[-1]
        if call.name is None:
            call.held.append(piece)
        else:
            self.out.append(CallPiece(len(self.calls) - 1, piece))

    def _in_args(self) -> bool:
        return self.region is not None

    def _char(self, c: str) -> None:
        if self.string is not None:
            self._string_char(c)
            return
        if self.atom and not (c.isalnum() or c in "+-."):
            self._atom_done()
        if c in " \t\r\n":
            return
        if c == '"':
            self._value_start()
            self.string = []
            self.string_is_key = bool(self.want_key and self.want_key[-1] and self.stack[-1] == "{")
            if self._in_args():
                if len(self.stack) == self.region:  # the arguments written as a JSON string
                    self.calls[-1].string_args = []
                else:
                    self._emit('"')
        elif c in "{[":
            self._value_start()
            if len(self.stack) == self.call_depth and c == "{":
                self.calls.append(_Call(f"call_{uuid.uuid4().hex[:24]}"))
            if self._in_args():
                self._emit(c)
            self.stack.append(c)
            self.keys.append(None)
            self.want_key.append(c == "{")
        elif c in "}]" and self.stack:
            self.stack.pop()
            self.keys.pop()
            self.want_key.pop()
            if self._in_args():
                self._emit(c)
                if len(self.stack) == self.region:
                    self.region = None
        elif c == ":" and self.stack:
            if self._in_args():
                self._emit(": ")
        elif c == "," and self.stack:
            if self._in_args():
                self._emit(", ")
            if self.stack[-1] == "{":
                self.want_key[-1] = True
        elif self.stack:  # a number or a literal
            if not self.atom:
                self._value_start()
            self.atom += c

    def _value_start(self) -> None:
        """A value (or key) begins: the arguments value of a call opens the region that is sent."""
        at_call = len(self.stack) == self.call_depth + 1 and self.stack[-1] == "{" and self.calls
        if at_call and not self.want_key[-1] and self.region is None and self.keys[-1] in self.args_keys:
            self.region = len(self.stack)

    def _string_char(self, c: str) -> None:
        assert self.string is not None
        if self.escape is not None:
            self.escape += c
            if self.escape[1] == "u" and len(self.escape) < 6:
                return
            decoded = chr(int(self.escape[2:], 16)) if self.escape[1] == "u" else _SIMPLE_ESCAPES.get(c, c)
            self.escape = None
            self._string_text(decoded)
        elif c == "\\":
            self.escape = c
        elif c == '"':
            self._string_done()
        else:
            self._string_text(c)

    def _string_text(self, s: str) -> None:
        assert self.string is not None
        self.string.append(s)
        if self._in_args() and len(self.stack) != self.region:
            self._emit(json.dumps(s)[1:-1])

    def _string_done(self) -> None:
        text = "".join(self.string or [])
        self.string = None
        if self.string_is_key:
            self.keys[-1] = text
            self.want_key[-1] = False
            if self._in_args():
                self._emit('"')
            return
        at_call = self.calls and len(self.stack) == self.call_depth + 1 and self.stack[-1] == "{"
        if self._in_args():
            if len(self.stack) == self.region:  # the arguments were a JSON string
                self.region = None
                self.calls[-1].string_args = [text]
                self._string_args_done(self.calls[-1])
            else:
                self._emit('"')
        elif at_call and self.keys[-1] == "name" and self.calls[-1].name is None:
            call = self.calls[-1]
            call.name = text
            self.out.append(CallPiece(len(self.calls) - 1, "".join(call.held), call.id, text))
            call.held = []

    def _string_args_done(self, call: _Call) -> None:
        """Arguments written as a JSON string: the object it holds, normalized, in one piece."""
        text = "".join(call.string_args or [])
        try:
            piece = json.dumps(json.loads(text))
        except ValueError:
            piece = json.dumps(text)
        self._emit(piece)

    def _atom_done(self) -> None:
        atom, self.atom = self.atom, ""
        if self._in_args():
            try:
                self._emit(json.dumps(json.loads(atom)))
            except ValueError:
                self._emit(atom)
            if len(self.stack) == self.region:
                self.region = None


def _merge(pieces: list[CallPiece]) -> list[CallPiece]:
    """Consecutive pieces of one call as one (a call's first piece keeps its id and name)."""
    out: list[CallPiece] = []
    for p in pieces:
        if out and out[-1].index == p.index and p.id is None:
            out[-1].arguments += p.arguments
        else:
            out.append(p)
    return out


def whole_calls(pieces: list[CallPiece]) -> list[dict[str, Any]]:
    """The calls ``pieces`` add up to, as a message's ``tool_calls``."""
    calls: list[dict[str, Any]] = []
    for p in pieces:
        if p.id is not None:
            calls.append({"id": p.id, "type": "function", "function": {"name": p.name, "arguments": ""}})
        calls[p.index]["function"]["arguments"] += p.arguments
    return calls
