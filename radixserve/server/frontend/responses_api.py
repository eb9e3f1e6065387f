"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``.

A response is a chat completion underneath: the request's ``instructions`` and ``input`` items
become chat messages (``message`` items as they are, ``function_call`` items as an assistant turn's
tool calls, ``function_call_output`` items as tool messages; earlier ``reasoning`` items are left
out, as chat templates leave out earlier thinking), ``tools`` and ``tool_choice`` their chat forms,
``text.format`` the ``response_format``, ``reasoning.effort`` the ``reasoning_effort``; the chat
machinery runs it (openai_api.py, chat_run.py) and its answer comes back as output items:
``reasoning`` (with ``--reasoning-parser``), ``message`` (``output_text``) and ``function_call``.
The request body and its translation are in responses_protocol.py.

Stored responses (``store``, true by default) are kept in this server's memory, the newest
``STORE_SIZE`` of them, for ``GET`` and for ``previous_response_id``: the conversation so far (not
its instructions, as OpenAI) comes before the new input. Streams send OpenAI's typed events
(``event: response.output_text.delta`` ...), each with its ``sequence_number``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from radixserve.server.frontend.call_stream import CallPiece
from radixserve.server.frontend.chat_protocol import ChatCompletionRequest
from radixserve.server.frontend.chat_run import ChatRun, ChoiceDeltas
from radixserve.server.frontend.common import SSE_HEADERS, dead_error
from radixserve.server.frontend.openai_api import OpenAIServing, _usage
from radixserve.server.frontend.protocol import APIError, parse_body, unsupported
from radixserve.server.frontend.req_state import ReqState
from radixserve.server.frontend.responses_protocol import STORE_SIZE, ResponsesRequest, chat_body
from radixserve.server.frontend.tokenizer_manager import ClientGone, ServerDead
from radixserve.server.frontend.tool_calls import ToolCall

# the response's id, as a header too: a router sends later requests that continue it (and reads of
# it) to the worker that stores it without reading the body
RESPONSE_ID_HEADER = "x-response-id"


class ResponseStore:
    """The newest stored responses: the response object, and the conversation it ends (chat
    messages, without instructions) for a ``previous_response_id``."""

    def __init__(self, size: int = STORE_SIZE) -> None:
        self.size = size
        self.items: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = OrderedDict()
        self.inputs: dict[str, list[dict[str, Any]]] = {}  # each stored response's input items

    def put(self, resp: dict[str, Any], conversation: list[dict[str, Any]], inputs: list[dict[str, Any]]) -> None:
        self.items[resp["id"]] = (resp, conversation)
        self.inputs[resp["id"]] = inputs
        while len(self.items) > self.size:
            gone, _ = self.items.popitem(last=False)
            del self.inputs[gone]

    def drop(self, rid: str) -> None:
        self.get(rid)
        del self.items[rid], self.inputs[rid]

    def get(self, rid: str, param: str | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        got = self.items.get(rid)
        if got is None:
            raise APIError(f"Response with id '{rid}' not found.", status_code=404, param=param, code="not_found")
        return got


# --- the answer -> output items ----------------------------------------------------------------------
def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def input_items(inp: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A request's ``input`` as the items OpenAI lists back: each with an id, messages with their
    content as parts."""
    out: list[dict[str, Any]] = []
    given: list[dict[str, Any]] = [{"role": "user", "content": inp}] if isinstance(inp, str) else inp
    for item in given:
        it: dict[str, Any] = dict(item)
        kind = it.setdefault("type", "message")
        if kind == "message":
            content = it.get("content")
            if isinstance(content, str):
                part = "output_text" if it.get("role") == "assistant" else "input_text"
                it["content"] = [{"type": part, "text": content}]
            it.setdefault("status", "completed")
        it.setdefault("id", _id({"message": "msg", "function_call": "fc"}.get(kind, "item")))
        out.append(it)
    return out


def reasoning_item(text: str, item_id: str | None = None) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id or _id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def message_item(text: str, status: str, logprobs: list[dict[str, Any]] | None,
                 item_id: str | None = None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return {"type": "message", "id": item_id or _id("msg"), "status": status, "role": "assistant", "content": [part]}


def call_item(call: dict[str, Any], item_id: str | None = None) -> dict[str, Any]:
    fn = call["function"]
    return {"type": "function_call", "id": item_id or _id("fc"), "call_id": call["id"], "name": fn["name"],
            "arguments": fn["arguments"], "status": "completed"}


def assistant_turn(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The output items as chat messages, for the next turn of the conversation."""
    msg: dict[str, Any] = {"role": "assistant", "content": None}
    for it in items:
        if it["type"] == "message":
            msg["content"] = it["content"][0]["text"]
        elif it["type"] == "function_call":
            msg.setdefault("tool_calls", []).append(
                {"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}})
    return [msg] if msg["content"] is not None or msg.get("tool_calls") else []


class ResponsesServing:
    def __init__(self, openai: OpenAIServing) -> None:
        self.openai = openai
        self.tm = openai.tm
        self.store = ResponseStore()

    async def create(self, request: Request) -> Response:
        body = parse_body(await request.body(), ResponsesRequest)
        if (body.reasoning or {}).get("effort") is not None and self.tm.args.reasoning_parser is None:
            raise unsupported("reasoning.effort", "this server runs no reasoning parser (--reasoning-parser)")
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            history = list(self.store.get(body.previous_response_id, "previous_response_id")[1])
        chat = chat_body(body, history)
        cbody = parse_body(json.dumps(chat).encode(), ChatCompletionRequest)
        run = await self.openai.start_chat(request, cbody)
        rid, created = _id("resp"), int(time.time())
        conversation = chat["messages"][1:] if body.instructions is not None else chat["messages"]
        if body.stream:
            first = await run.call.first_outputs()
            stream = ResponseStream(self, body, run, rid, created, conversation)
            return StreamingResponse(stream.events(first), media_type="text/event-stream",
                                     headers={**SSE_HEADERS, RESPONSE_ID_HEADER: rid})
        try:
            (st,) = await run.call.wait_all()
        except ClientGone:
            return Response(status_code=499)
        choice = self.openai.chat_choice(run, st)
        msg, finish = choice["message"], choice["finish_reason"]
        status = "incomplete" if finish == "length" else "completed"
        items: list[dict[str, Any]] = []
        if msg.get("reasoning_content"):
            items.append(reasoning_item(msg["reasoning_content"]))
        if msg.get("content") or not (msg.get("tool_calls") or msg.get("reasoning_content")):  # else nothing said
            lp = choice["logprobs"]["content"] if choice["logprobs"] is not None else None
            items.append(message_item(msg.get("content") or "", status, lp))
        items += [call_item(c) for c in msg.get("tool_calls") or []]
        resp = self.response(body, rid, created, status, items, [st], msg.get("reasoning_content") or "")
        self.keep(body, resp, conversation + assistant_turn(items))
        return JSONResponse(resp, headers={RESPONSE_ID_HEADER: rid})

    def keep(self, body: ResponsesRequest, resp: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        if body.store and resp["status"] != "failed":
            self.store.put(resp, conversation, input_items(body.input))

    def response(self, body: ResponsesRequest, rid: str, created: int, status: str, output: list[dict[str, Any]],
                 states: list[ReqState] | None, reasoning: str, error: dict[str, Any] | None = None) -> dict[str, Any]:
        usage = None
        if states is not None:
            u = _usage(states, 1)
            rtoks = len(self.tm.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
            usage = {"input_tokens": u["prompt_tokens"], "input_tokens_details": u["prompt_tokens_details"],
                     "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": rtoks},
                     "total_tokens": u["total_tokens"]}
        return {
            "id": rid, "object": "response", "created_at": created, "status": status, "background": False,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "max_tool_calls": None,
            "model": self.tm.model_name, "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": (body.reasoning or {}).get("effort"), "summary": None},
            "service_tier": body.service_tier or "default", "store": body.store,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": body.text or {"format": {"type": "text"}},
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "tools": body.tools or [], "top_logprobs": body.top_logprobs or 0,
            "top_p": 1.0 if body.top_p is None else body.top_p, "truncation": "disabled", "usage": usage,
            "user": body.user, "metadata": body.metadata or {},
        }

    def retrieve(self, rid: str) -> dict[str, Any]:
        return self.store.get(rid)[0]

    def delete(self, rid: str) -> dict[str, Any]:
        self.store.drop(rid)
        return {"id": rid, "object": "response.deleted", "deleted": True}

    def list_input_items(self, rid: str, limit: int = 20, order: str = "desc", after: str | None = None
                         ) -> dict[str, Any]:
        """OpenAI's ``GET /v1/responses/{id}/input_items``: the input items of a stored response (its
        own request's, not those of the responses before it), a page at a time."""
        self.store.get(rid)
        if not 1 <= limit <= 100:
            raise APIError("limit must be between 1 and 100", param="limit", code="invalid_value")
        if order not in ("asc", "desc"):
            raise APIError('order must be "asc" or "desc"', param="order", code="invalid_value")
        items = self.store.inputs[rid] if order == "asc" else self.store.inputs[rid][::-1]
        if after is not None:
            ids = [it["id"] for it in items]
            if after not in ids:
                raise APIError(f"No input item with id '{after}' in this response.", param="after",
                               code="invalid_value")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


class ResponseStream:
    """A response as OpenAI's stream of typed events: created, in progress, each output item added,
    its deltas and done, then completed (or incomplete, or failed)."""

    def __init__(self, serving: ResponsesServing, body: ResponsesRequest, run: ChatRun, rid: str, created: int,
                 conversation: list[dict[str, Any]]) -> None:
        self.serving, self.body, self.run = serving, body, run
        self.rid, self.created, self.conversation = rid, created, conversation
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # output items done
        self.open: dict[str, Any] | None = None  # the item being streamed: reasoning or message
        self.text = ""
        self.reasoning = ""
        self.logprobs: list[dict[str, Any]] = []
        self.open_call: dict[str, Any] | None = None  # a forced call being written

    def _event(self, kind: str, **data: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()

    def _snapshot(self, status: str, states: list[ReqState] | None = None,
                  error: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.serving.response(self.body, self.rid, self.created, status, list(self.items), states,
                                     self.reasoning, error)

    def _begin(self, kind: str) -> list[bytes]:
        """Close the open item unless it is of ``kind``; open one of ``kind`` if none is."""
        out = self._close() if self.open is not None and self.open["type"] != kind else []
        if self.open is None:
            idx = len(self.items)
            if kind == "reasoning":
                self.open = {"type": "reasoning", "id": _id("rs"), "summary": [], "content": []}
                out.append(self._event("response.output_item.added", output_index=idx, item=self.open))
            else:
                self.open = {"type": "message", "id": _id("msg"), "status": "in_progress", "role": "assistant",
                             "content": []}
                out.append(self._event("response.output_item.added", output_index=idx, item=self.open))
                out.append(self._event("response.content_part.added", item_id=self.open["id"], output_index=idx,
                                       content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        return out

    def _close(self, status: str = "completed") -> list[bytes]:
        item, idx = self.open, len(self.items)
        if item is None:
            return []
        self.open = None
        if item["type"] == "reasoning":
            done = reasoning_item(self.reasoning, item["id"])
            out = [self._event("response.reasoning_text.done", item_id=item["id"], output_index=idx, content_index=0,
                               text=self.reasoning)]
        else:
            lp = self.logprobs if self.run.body.logprobs else None
            done = message_item(self.text, status, lp, item["id"])
            out = [self._event("response.output_text.done", item_id=item["id"], output_index=idx, content_index=0,
                               text=self.text, logprobs=self.logprobs),
                   self._event("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0,
                               part=done["content"][0])]
        self.items.append(done)
        out.append(self._event("response.output_item.done", output_index=idx, item=done))
        return out

    def _call(self, call: ToolCall) -> list[bytes]:
        idx, done = len(self.items), call_item(call.to_openai())
        item_id = done["id"]
        self.items.append(done)
        return [self._event("response.output_item.added", output_index=idx,
                            item={**done, "arguments": "", "status": "in_progress"}),
                self._event("response.function_call_arguments.delta", item_id=item_id, output_index=idx,
                            delta=done["arguments"]),
                self._event("response.function_call_arguments.done", item_id=item_id, output_index=idx,
                            arguments=done["arguments"]),
                self._event("response.output_item.done", output_index=idx, item=done)]

    def _pieces(self, pieces: list[CallPiece]) -> list[bytes]:
        """Forced calls as they are written: a call's item opens with its name (closing what was
        open), its arguments go out as deltas; it is done when the next one opens or the answer ends."""
        out: list[bytes] = []
        for p in pieces:
            if p.id is not None:
                out += self._close() + self._close_call()
                idx = len(self.items)
                item = call_item({"id": p.id, "function": {"name": p.name, "arguments": ""}})
                self.open_call = item
                out.append(self._event("response.output_item.added", output_index=idx,
                                       item={**item, "status": "in_progress"}))
            assert self.open_call is not None
            if p.arguments:
                self.open_call["arguments"] += p.arguments
                out.append(self._event("response.function_call_arguments.delta", item_id=self.open_call["id"],
                                       output_index=len(self.items), delta=p.arguments))
        return out

    def _close_call(self) -> list[bytes]:
        item, idx = self.open_call, len(self.items)
        if item is None:
            return []
        self.open_call = None
        self.items.append(item)
        return [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=idx,
                            arguments=item["arguments"]),
                self._event("response.output_item.done", output_index=idx, item=item)]

    async def events(self, first: list[tuple[ReqState, Any]]) -> AsyncIterator[bytes]:
        call, openai = self.run.call, self.serving.openai
        deltas = ChoiceDeltas(self.run)
        yield self._event("response.created", response=self._snapshot("in_progress"))
        yield self._event("response.in_progress", response=self._snapshot("in_progress"))
        try:
            async for st, o in call.stream(first):
                err = call.error_of(o)
                if err is not None:
                    for chunk in self._fail(err):
                        yield chunk
                    return
                deltas.start(st.index)
                d = deltas.feed(st.index, o)
                if d.reasoning:
                    for chunk in self._begin("reasoning"):
                        yield chunk
                    self.reasoning += d.reasoning
                    yield self._event("response.reasoning_text.delta", item_id=self.open["id"],  # type: ignore[index]
                                      output_index=len(self.items), content_index=0, delta=d.reasoning)
                lp = (openai.lp.chat(o.new_token_ids, o.new_logprobs, o.new_top_logprobs)
                      if self.run.body.logprobs and o.new_token_ids else [])
                self.logprobs += lp
                if d.content:
                    for chunk in self._begin("message"):
                        yield chunk
                    self.text += d.content
                    yield self._event("response.output_text.delta", item_id=self.open["id"],  # type: ignore[index]
                                      output_index=len(self.items), content_index=0, delta=d.content, logprobs=lp)
                for chunk in self._pieces(d.pieces):
                    yield chunk
                if d.finish is not None:
                    status = "incomplete" if d.finish == "length" else "completed"
                    for chunk in self._close_call():
                        yield chunk
                    if self.open is None and not d.calls and not self.items:  # nothing at all was said
                        for chunk in self._begin("message"):
                            yield chunk
                    for chunk in self._close(status):
                        yield chunk
                    for c in d.calls:
                        for chunk in self._call(c):
                            yield chunk
                    assert call.group is not None
                    resp = self._snapshot(status, call.group.states)
                    self.serving.keep(self.body, resp, self.conversation + assistant_turn(self.items))
                    yield self._event("response.completed" if status == "completed" else "response.incomplete",
                                      response=resp)
        except ClientGone:
            return
        except Exception as e:
            for chunk in self._fail(e):
                yield chunk
        finally:
            call.close()

    def _fail(self, e: BaseException) -> list[bytes]:
        err = (e if isinstance(e, APIError) else dead_error(e) if isinstance(e, ServerDead)
               else APIError(f"internal error: {e}", 500, "server_error", "internal_error"))
        body = err.to_json()["error"]
        return [self._event("error", code=body.get("code"), message=body.get("message"), param=body.get("param")),
                self._event("response.failed", response=self._snapshot(
                    "failed", error={"code": body.get("code") or "server_error", "message": body.get("message")}))]
