"""One chat request in flight, and how its streamed output splits into reasoning, content and tool
calls. Shared by ``/v1/chat/completions`` (openai_api.py) and ``/v1/responses`` (responses_api.py),
which render the same pieces as different wire formats."""

from __future__ import annotations

from dataclasses import dataclass, field

from radixserve.sched.io import OutRow
from radixserve.server.frontend.call_stream import CallPiece, CallStream
from radixserve.server.frontend.chat_protocol import ChatCompletionRequest
from radixserve.server.frontend.common import Call
from radixserve.server.frontend.reasoning import ReasoningFormat, ReasoningSplitter
from radixserve.server.frontend.tool_calls import StreamedAnswer, ToolCall


@dataclass
class ChatRun:
    call: Call  # open: its requests were sent
    body: ChatCompletionRequest
    fmt: ReasoningFormat | None  # the answer's thinking is split off (--reasoning-parser)
    parser: str | None  # the answer is read for tool calls with this parser
    rid: str
    created: int

    @property
    def forced(self) -> bool:
        """The answer is calls a grammar forced (read as they are written: call_stream.py)."""
        body = self.body
        return self.parser is not None and bool(body.tools) and body.forced_tools() is not None


@dataclass
class Delta:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)  # whole calls, at the end (tool_choice auto)
    pieces: list[CallPiece] = field(default_factory=list)  # forced calls, as they are written
    finish: str | None = None  # the OpenAI finish reason, on the last delta


class ChoiceDeltas:
    """Each streamed choice's next output, split: reasoning first (with a reasoning format), then
    the content, holding back text where a tool call may begin; the calls come whole at the end
    (whether a call the model chose to write parses is known at its end), or, forced by a grammar,
    in pieces as they are written."""

    def __init__(self, run: ChatRun) -> None:
        self.run = run
        self.names = run.body.tool_names()
        self.splitters: dict[int, ReasoningSplitter] = {}
        self.answers: dict[int, StreamedAnswer] = {}
        self.forced: dict[int, CallStream] = {}
        self.started: set[int] = set()

    def start(self, index: int) -> bool:
        """True the first time ``index`` is seen (the caller opens that choice)."""
        if index in self.started:
            return False
        self.started.add(index)
        if self.run.fmt is not None:
            self.splitters[index] = ReasoningSplitter(self.run.fmt)
        if self.run.parser is not None and self.run.forced:
            self.forced[index] = CallStream(self.run.parser)
        elif self.run.parser is not None:
            self.answers[index] = StreamedAnswer(self.run.parser, self.names)
        return True

    def feed(self, index: int, out: OutRow) -> Delta:
        fr = out.finished_reason
        final = fr is not None
        d = Delta(content=out.text, finish=fr.openai_reason if fr is not None else None)
        if index in self.splitters:
            d.reasoning, d.content = self.splitters[index].feed(out.text, final=final)
        if index in self.answers:
            d.content, d.calls = self.answers[index].feed(d.content, final=final)
            if d.calls and d.finish == "stop":
                d.finish = "tool_calls"
        elif index in self.forced:
            d.pieces, d.content = self.forced[index].feed(d.content, final=final), ""
            if final and self.forced[index].calls and d.finish == "stop":
                d.finish = "tool_calls"
        return d
