"""OpenAI-compatible ``/v1/chat/completions`` and ``/v1/completions`` (streaming and not).

``n`` fans out into n requests with derived rids (seeds ``seed + i`` when seeded); usage counts
a prompt once per prompt, as OpenAI does. Streams end with ``data: [DONE]``; the usage-only chunk
(empty ``choices``) is sent only with ``stream_options.include_usage``. An error after the stream
started is sent as a ``data: {"error": ...}`` event. ``/v1/completions`` takes vLLM's
``return_token_ids``: each choice (each chunk, streamed) then carries ``token_ids``, and
``prompt_token_ids`` once; ``radixserve bench serve`` builds multi-turn histories from them.
With ``--reasoning-parser`` a chat answer's thinking is its ``reasoning_content`` (reasoning.py);
with tools, its calls are ``tool_calls`` (tool_calls.py): a stream holds the text back from where a
call may begin, and sends each call whole at the end.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from radixserve.grammar import GRAMMAR_KINDS, validate_grammar
from radixserve.sched.io import OutRow
from radixserve.server.frontend.call_stream import CallStream, whole_calls
from radixserve.server.frontend.chat_protocol import ChatCompletionRequest
from radixserve.server.frontend.chat_run import ChatRun, ChoiceDeltas
from radixserve.server.frontend.common import (
    SSE_DONE,
    SSE_HEADERS,
    Call,
    check_prompt,
    input_logprob_start,
    parse_sampling_params,
    render_chat,
    resolve_max_tokens,
    sse,
    stream_error,
)
from radixserve.server.frontend.logprob_format import LogprobFormat
from radixserve.server.frontend.pd_fields import bootstrap_fields
from radixserve.server.frontend.protocol import APIError, CompletionRequest, parse_body, unsupported
from radixserve.server.frontend.reasoning import FORMATS, ReasoningFormat, after_reasoning, split_reasoning
from radixserve.server.frontend.req_state import ReqState
from radixserve.server.frontend.sched_fields import SchedFields, sched_fields
from radixserve.server.frontend.tokenizer_manager import ClientGone, TokenizerManager
from radixserve.server.frontend.tool_calls import parse_tool_calls, tool_grammar, tools_system_prompt
from radixserve.server.io_struct import GenerateReq


class OpenAIServing:
    def __init__(self, tm: TokenizerManager, model_aliases: set[str]) -> None:
        self.tm = tm
        self.tokenizer = tm.tokenizer
        self.lp = LogprobFormat(tm.tokenizer)
        self.model_aliases = model_aliases | {tm.model_name}

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_aliases:
            raise APIError(f"The model `{model}` does not exist.", status_code=404, param="model",
                           code="model_not_found")

    # --- requests ----------------------------------------------------------------------------------
    def _make_reqs(
        self, prompts: list[list[int]], body: ChatCompletionRequest | CompletionRequest, max_tokens: int | None,
        logprobs: bool, top_logprobs: int, prompt_param: str,
        fields: SchedFields = (None, None, None, None), extra: dict[str, Any] | None = None,
        samples: int | None = None, input_logprobs: bool = False,
    ) -> list[GenerateReq]:
        """``samples`` requests per prompt (default ``body.n``); ``input_logprobs``: with the logprobs of
        every prompt token (``echo``)."""
        base = uuid.uuid4().hex
        reqs = []
        bootstrap = bootstrap_fields(body, self.tm.args.disaggregation_mode)
        for p, ids in enumerate(prompts):
            check_prompt(self.tm, ids, prompt_param)
            sp = parse_sampling_params(
                {**body.sampling_params(resolve_max_tokens(self.tm, len(ids), max_tokens, prompt_param), logprobs,
                                        top_logprobs), **(extra or {})},
                self.tm.info.get("vocab_size"), openai=True)
            start = input_logprob_start(self.tm, 0, len(ids), "echo") if input_logprobs else None
            for i in range(samples or body.n):
                spi = sp if sp.seed is None else msgspec.structs.replace(sp, seed=sp.seed + i)
                reqs.append(GenerateReq(f"{base}-{p}-{i}", ids, spi, body.priority, *fields,
                                        stream=bool(body.stream), bootstrap=bootstrap, input_logprob_start=start))
        return reqs

    # --- chat ----------------------------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        body = parse_body(await request.body(), ChatCompletionRequest)
        run = await self.start_chat(request, body)
        if body.stream:
            first = await run.call.first_outputs()
            return StreamingResponse(self._chat_stream(run, first), media_type="text/event-stream",
                                     headers=SSE_HEADERS)
        try:
            states = await run.call.wait_all()
        except ClientGone:
            return Response(status_code=499)
        return JSONResponse({
            "id": run.rid, "object": "chat.completion", "created": run.created, "model": self.tm.model_name,
            "choices": [self.chat_choice(run, st) for st in states], "usage": _usage(states, body.n),
        })

    async def start_chat(self, request: Request, body: ChatCompletionRequest) -> ChatRun:
        """Render the chat, build its requests and send them (the ``Call`` is open on return)."""
        self.check_model(body.model)
        fmt = self._reasoning_format(body)
        template_kwargs = dict(body.chat_template_kwargs or {})
        if body.reasoning_effort is not None:
            template_kwargs.setdefault("reasoning_effort", body.reasoning_effort)
        messages = [m.to_template() for m in body.messages]
        parser, template_tools, extra = self._tool_setup(body, fmt, messages)
        if fmt is not None:
            extra = _grammar_after_reasoning(fmt, extra or body.grammar_params()) or extra
        text = render_chat(self.tokenizer, messages, True, template_kwargs, template_tools)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        top = body.top_logprobs or 0
        if top and not body.logprobs:
            raise APIError("top_logprobs requires logprobs to be true", param="top_logprobs")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        reqs = self._make_reqs([ids], body, max_tokens, body.logprobs, top, "messages",
                               sched_fields(request, body, openai=True, dp_size=self.tm.dp_size,
                                            pd_mode=self.tm.args.disaggregation_mode), extra)
        call = Call(self.tm, request)
        await call.open(reqs)
        return ChatRun(call, body, fmt, parser, f"chatcmpl-{uuid.uuid4().hex}", int(time.time()))

    def chat_choice(self, run: ChatRun, st: ReqState) -> dict[str, Any]:
        """One finished choice: its message (content, reasoning, tool calls), logprobs and finish reason."""
        assert st.last is not None and st.last.finished_reason is not None
        body, fmt, parser = run.body, run.fmt, run.parser
        message: dict[str, Any] = {"role": "assistant", "content": st.text}
        if fmt is not None:
            reasoning, message["content"] = split_reasoning(fmt, st.text)
            message["reasoning_content"] = reasoning or None
        finish = st.last.finished_reason.openai_reason
        if parser is not None and run.forced:  # the same reading as the stream's (call_stream.py)
            forced = whole_calls(CallStream(parser).feed(message["content"], final=True))
            message["content"] = None  # (all of it is calls; the stream sends no content either)
            if forced:
                message["tool_calls"] = forced
                finish = "tool_calls" if finish == "stop" else finish
        elif parser is not None:
            message["content"], calls = parse_tool_calls(parser, message["content"], body.tool_names())
            if calls:
                message["content"] = message["content"] or None
                message["tool_calls"] = [c.to_openai() for c in calls]
                finish = "tool_calls" if finish == "stop" else finish  # a cut answer says so
        return {
            "index": st.index,
            "message": message,
            "logprobs": {"content": self.lp.chat(st.output_ids, st.logprobs, st.top_logprobs)}
            if body.logprobs else None,
            "finish_reason": finish,
        }

    def _tool_setup(
        self, body: ChatCompletionRequest, fmt: ReasoningFormat | None, messages: list[dict[str, Any]]
    ) -> tuple[str | None, list[dict[str, Any]] | None, dict[str, Any] | None]:
        """(the parser the answer is read with, the tools for the template, sampling fields to
        add: the grammar of a forced call). ``messages`` gains a system message describing the
        tools when the chat template takes none."""
        if not body.tools or body.tool_choice == "none":
            return None, None, None
        forced = body.forced_tools()
        parser = self.tm.args.tool_call_parser
        if forced is None and parser is None:
            raise unsupported("tool_choice", "tool_choice auto needs the server's --tool-call-parser (required or a "
                              "named function work without one)")
        tools: list[dict[str, Any]] | None = body.tools
        if "tools" not in (self.tokenizer.chat_template or ""):  # the template cannot show them
            messages.insert(0, {"role": "system", "content": tools_system_prompt(body.tools)})
            tools, parser = None, "hermes"
        parser = parser or "hermes"
        if forced is None:
            return parser, tools, None
        if body.grammar_params():
            raise APIError("a forced tool call is a grammar of its own: drop response_format / regex / ebnf",
                           param="tool_choice", code="invalid_value")
        try:
            grammar = tool_grammar(parser, forced, parallel=body.parallel_tool_calls is not False)
        except ValueError as e:
            raise unsupported("tool_choice", str(e)) from None
        return parser, tools, {"ebnf": grammar}

    def _reasoning_format(self, body: ChatCompletionRequest) -> ReasoningFormat | None:
        """How this request's answer is split into reasoning and content (None: it is not)."""
        parser = self.tm.args.reasoning_parser
        if parser is None:
            if body.reasoning_effort is not None:
                raise unsupported("reasoning_effort", "this server runs no reasoning parser (--reasoning-parser)")
            return None
        if not body.separate_reasoning:
            return None
        return FORMATS[parser]

    async def _chat_stream(self, run: ChatRun, first: list[tuple[ReqState, OutRow]]) -> AsyncIterator[bytes]:
        body, call = run.body, run.call
        base = {"id": run.rid, "object": "chat.completion.chunk", "created": run.created, "model": self.tm.model_name}
        if body.include_usage:
            base["usage"] = None
        deltas = ChoiceDeltas(run)
        assert call.group is not None
        try:
            async for st, o in call.stream(first):
                fr = o.finished_reason
                err = call.error_of(o)
                if err is not None:
                    yield stream_error(err)
                    yield SSE_DONE
                    return
                if deltas.start(st.index):
                    yield sse({**base, "choices": [{"index": st.index, "delta": {"role": "assistant", "content": ""},
                                                    "logprobs": None, "finish_reason": None}]})
                lp = ({"content": self.lp.chat(o.new_token_ids, o.new_logprobs, o.new_top_logprobs)}
                      if body.logprobs and o.new_token_ids else None)
                if o.text or lp is not None or fr is not None:
                    d = deltas.feed(st.index, o)
                    delta: dict[str, Any] = {k: v for k, v in (("reasoning_content", d.reasoning),
                                                               ("content", d.content)) if v}
                    if d.calls:
                        delta["tool_calls"] = [c.to_openai(i) for i, c in enumerate(d.calls)]
                    elif d.pieces:
                        delta["tool_calls"] = [p.to_openai() for p in d.pieces]
                    yield sse({**base, "choices": [{"index": st.index, "delta": delta, "logprobs": lp,
                                                    "finish_reason": d.finish}]})
            if body.include_usage:
                yield sse({**base, "choices": [], "usage": _usage(call.group.states, body.n)})
            yield SSE_DONE
        except ClientGone:
            return
        except Exception as e:
            yield stream_error(e)
            yield SSE_DONE
        finally:
            call.close()

    # --- completions ------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        body = parse_body(await request.body(), CompletionRequest)
        self.check_model(body.model)
        prompt = body.prompt
        texts: list[str | None]
        if isinstance(prompt, str):
            prompts, texts = [self.tokenizer.encode(prompt)], [prompt]
        elif prompt and all(isinstance(p, str) for p in prompt):
            texts = list(prompt)  # type: ignore[arg-type]
            prompts = [self.tokenizer.encode(t) for t in texts if t is not None]
        elif prompt and all(isinstance(p, list) for p in prompt):
            prompts = [list(p) for p in prompt]  # type: ignore[arg-type]
            texts = [None] * len(prompts)
        elif all(isinstance(p, int) for p in prompt):
            prompts, texts = [list(prompt)], [None]  # type: ignore[arg-type]
        else:
            raise APIError("prompt must be a string, a list of strings, a list of token ids or a list of lists",
                           param="prompt")
        if not prompts:
            raise APIError("the prompt is empty", param="prompt")
        nlp = body.logprobs
        k = body.samples  # best_of > n: the samples are ranked by their total logprob, so they need them
        reqs = self._make_reqs(prompts, body, body.max_tokens, nlp is not None or k > body.n, nlp or 0, "prompt",
                               sched_fields(request, body, openai=True, dp_size=self.tm.dp_size,
                                            pd_mode=self.tm.args.disaggregation_mode), samples=k,
                               input_logprobs=body.echo and nlp is not None)
        echo = [(t if t is not None else self.tokenizer.decode(ids)) if body.echo else ""
                for t, ids in zip(texts, prompts, strict=True)]
        call = Call(self.tm, request)
        await call.open(reqs)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            first = await call.first_outputs()
            return StreamingResponse(self._completion_stream(call, first, body, rid, created, echo, prompts),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        try:
            states = await call.wait_all()
        except ClientGone:
            return Response(status_code=499)
        choices = []
        for index, st in enumerate(_best(states, k, body.n)):
            assert st.last is not None and st.last.finished_reason is not None
            prefix = echo[st.index // k]
            choice = {
                "index": index,
                "text": prefix + st.text,
                "logprobs": self.lp.echoed(st, self.lp.completion(st.output_ids, st.logprobs, st.top_logprobs,
                                                                       len(prefix)))
                if nlp is not None else None,
                "finish_reason": st.last.finished_reason.openai_reason,
            }
            if body.return_token_ids:
                choice["prompt_token_ids"] = prompts[st.index // k]
                choice["token_ids"] = list(st.output_ids)
            choices.append(choice)
        return JSONResponse({
            "id": rid, "object": "text_completion", "created": created, "model": self.tm.model_name,
            "choices": choices, "usage": _usage(states, k),  # every sample drawn counts, as OpenAI bills them
        })

    async def _completion_stream(
        self, call: Call, first: list[tuple[ReqState, OutRow]], body: CompletionRequest, rid: str, created: int,
        echo: list[str], prompts: list[list[int]],
    ) -> AsyncIterator[bytes]:
        base = {"id": rid, "object": "text_completion", "created": created, "model": self.tm.model_name}
        if body.include_usage:
            base["usage"] = None
        offsets: dict[int, int] = {}
        assert call.group is not None
        try:
            async for st, o in call.stream(first):
                fr = o.finished_reason
                err = call.error_of(o)
                if err is not None:
                    yield stream_error(err)
                    yield SSE_DONE
                    return
                text = o.text
                extra: dict[str, Any] = {"token_ids": list(o.new_token_ids)} if body.return_token_ids else {}
                opening = st.index not in offsets
                if opening:  # the echoed prompt leads; the outputs' text offsets count from its end
                    prefix = echo[st.index // body.n]
                    text = prefix + text
                    offsets[st.index] = len(prefix)
                    if body.return_token_ids:
                        extra["prompt_token_ids"] = prompts[st.index // body.n]
                lp = None
                if body.logprobs is not None and (o.new_token_ids or (opening and st.input_logprobs is not None)):
                    lp = self.lp.completion(o.new_token_ids, o.new_logprobs, o.new_top_logprobs,
                                                   offsets[st.index])
                    if opening:
                        lp = self.lp.echoed(st, lp)
                offsets[st.index] += len(o.text)
                # NOTE: with token ids, a token whose text is still held back (part of a character
                # or of a possible stop string) gets a chunk of its own, so no id goes missing
                if text or lp is not None or fr is not None or extra.get("token_ids"):
                    yield sse({**base, "choices": [{"index": st.index, "text": text, "logprobs": lp,
                                                    "finish_reason": fr.openai_reason if fr else None, **extra}]})
            if body.include_usage:
                yield sse({**base, "choices": [], "usage": _usage(call.group.states, body.n)})
            yield SSE_DONE
        except ClientGone:
            return
        except Exception as e:
            yield stream_error(e)
            yield SSE_DONE
        finally:
            call.close()

_GRAMMAR_PARAM = {"json_schema": "response_format", "regex": "regex", "ebnf": "ebnf"}


def _grammar_after_reasoning(fmt: ReasoningFormat, grammar: dict[str, Any]) -> dict[str, Any] | None:
    """The sampling fields that put a request's grammar (structured output or a forced call) after its
    reasoning part (None: it has no one grammar); the grammar is checked first, so a bad one is a 400
    naming the field the client wrote."""
    kinds = [k for k in GRAMMAR_KINDS if grammar.get(k) is not None]
    if len(kinds) != 1:  # none, or several: SamplingParams refuses those
        return None
    kind = kinds[0]
    err = validate_grammar(kind, grammar[kind])
    if err is not None:
        raise APIError(f"invalid {kind}: {err}", param=_GRAMMAR_PARAM[kind], code="invalid_value")
    return {"json_schema": None, "regex": None, "ebnf": after_reasoning(fmt, kind, grammar[kind])}


def _best(states: list[ReqState], samples: int, n: int) -> list[ReqState]:
    """Each prompt's ``n`` samples of highest total logprob, best first (all of them, in order,
    when ``samples == n``)."""
    if samples == n:
        return states
    out: list[ReqState] = []
    for p in range(0, len(states), samples):
        group = states[p : p + samples]
        out += sorted(group, key=lambda st: -sum(st.logprobs))[:n]
    return out


def _usage(states: list[ReqState], n: int) -> dict[str, Any]:
    prompt = cached = completion = 0
    for st in states:
        if st.last is None:
            continue
        completion += st.last.completion_tokens
        if st.index % n == 0:  # a prompt counts once however many choices it has
            prompt += st.last.prompt_tokens
            cached += st.last.cached_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}
