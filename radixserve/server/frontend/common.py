"""What the OpenAI and the native endpoints share: turning prompts into ``GenerateReq``s with the
same checks, running one HTTP request's generation while watching its client, SSE framing."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import jinja2
from starlette.requests import Request
from starlette.responses import JSONResponse

from radixserve.model.tokenizer import ChatTemplateError, Tokenizer
from radixserve.sched.finish import FINISH_ABORT
from radixserve.sched.io import OutRow
from radixserve.sched.request_checks import Limits, logprob_start, max_new_tokens, prompt_error
from radixserve.sched.sampling_params import InvalidRequest, SamplingParams
from radixserve.server.frontend.chat_protocol import ChatMessage
from radixserve.server.frontend.protocol import APIError, unsupported
from radixserve.server.frontend.tokenizer_manager import (
    ClientGone,
    ReqState,
    RequestGroup,
    ServerDead,
    ServerDraining,
    TokenizerManager,
)
from radixserve.server.frontend.tool_calls import inline_tool_calls
from radixserve.server.io_struct import GenerateReq

# SamplingParams field -> the OpenAI parameter a client wrote
_OPENAI_PARAM = {"max_new_tokens": "max_tokens", "top_logprobs_num": "top_logprobs", "json_schema": "response_format",
                 "min_new_tokens": "min_tokens"}


def parse_sampling_params(sp: dict[str, Any], vocab_size: int | None, openai: bool) -> SamplingParams:
    """The request's ``SamplingParams``, validated here once (the scheduler trusts them), or a 400
    naming the field as the client wrote it."""
    try:
        return SamplingParams.from_dict(sp, vocab_size)
    except InvalidRequest as e:
        param = _OPENAI_PARAM.get(e.param or "", e.param) if openai else e.param
        raise APIError(str(e), param=param, code="unsupported" if e.code == "unsupported" else "invalid_value"
                       ) from None
    except TypeError as e:
        raise APIError(f"invalid sampling parameters: {e}", param="sampling_params") from None


def render_chat(
    tokenizer: Tokenizer, messages: list[ChatMessage] | list[dict[str, Any]], add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None, tools: list[dict[str, Any]] | None = None,
) -> str:
    """The prompt text of a chat, by the model's template; a template that fails is a 400."""
    dicts = [m.to_template() if isinstance(m, ChatMessage) else m for m in messages]
    if "tool_calls" not in (tokenizer.chat_template or ""):  # a template that would drop them
        dicts = inline_tool_calls(dicts)
    try:
        return tokenizer.apply_chat_template(dicts, add_generation_prompt, tools, **(template_kwargs or {}))
    except (ChatTemplateError, jinja2.TemplateError) as e:
        raise APIError(f"chat template error: {e}", param="messages") from None


def limits(tm: TokenizerManager) -> Limits:
    """What the scheduler runs requests within, as it reported at start-up."""
    return Limits(tm.info.get("vocab_size"), tm.context_len, int(tm.info.get("max_total_num_tokens", tm.context_len + 1)))


def check_prompt(tm: TokenizerManager, ids: list[int], param: str) -> None:
    """The prompt checks of ``sched.request_checks`` (the scheduler trusts them), as a 400."""
    err = prompt_error(ids, limits(tm), param)
    if err is not None:
        raise abort_error(err)


def input_logprob_start(tm: TokenizerManager, start: int | None, prompt_len: int, param: str) -> int | None:
    """The prompt token from which a request's prompt logprobs are wanted (None: none; -1 is SGLang's
    "the output only"), checked against the prompt and the server's mode."""
    got = logprob_start(start, prompt_len, param)
    if isinstance(got, FINISH_ABORT):
        raise abort_error(got)
    if got is not None and tm.args.disaggregation_mode != "null":
        raise unsupported(param, "prompt logprobs are not available with prefill/decode disaggregation")
    return got


def resolve_max_tokens(tm: TokenizerManager, prompt_len: int, max_tokens: int | None, prompt_param: str,
                       clip: bool = False, param: str = "max_tokens") -> int:
    """The output budget (``sched.request_checks.max_new_tokens``): OpenAI's endpoints refuse a
    prompt + max_tokens over the context, the native one clips it (``clip``); none means "as many as
    fit"; either way it must fit the KV pool. Refusals are 400s."""
    n = max_new_tokens(prompt_len, max_tokens, limits(tm), clip=clip, prompt_param=prompt_param, param=param)
    if isinstance(n, FINISH_ABORT):
        raise abort_error(n)
    return n


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.to_json(), status_code=e.status_code, headers=e.headers)


def abort_error(fr: FINISH_ABORT) -> APIError:
    headers = {"Retry-After": "1"} if fr.status_code == 429 else None
    return APIError(fr.message, status_code=fr.status_code, err_type=fr.err_type or "invalid_request_error",
                    code=fr.code or "aborted", param=fr.param, headers=headers)


def dead_error(e: ServerDead) -> APIError:
    """503: a draining server's (retry elsewhere at once), or a dead one's."""
    if isinstance(e, ServerDraining):
        return APIError(f"the server is shutting down: {e}", status_code=503, err_type="server_error",
                        code="server_draining", headers={"Retry-After": "1"})
    return APIError(f"the server is shutting down: {e}", status_code=503, err_type="server_error",
                    code="server_unavailable")


class Call:
    """One HTTP request's generation: its ``RequestGroup`` plus a watch on the client connection,
    so a client that goes away aborts its requests at once (not at the next chunk we send)."""

    def __init__(self, tm: TokenizerManager, request: Request, abort_is_error: bool = True) -> None:
        """``abort_is_error``: an abort by /abort_request (status 499) is an error too (OpenAI
        endpoints); SGLang's /generate returns it as a result with ``finish_reason.type == "abort"``."""
        self.tm = tm
        self.request = request
        self.abort_is_error = abort_is_error
        self.group: RequestGroup | None = None
        self.watcher: asyncio.Task[None] | None = None

    async def open(self, reqs: list[GenerateReq]) -> RequestGroup:
        try:
            self.group = await self.tm.open(reqs)
        except ServerDead as e:
            raise dead_error(e) from None
        except ValueError as e:
            raise APIError(str(e), param="rid") from None
        self.watcher = asyncio.create_task(self._watch())
        return self.group

    async def _watch(self) -> None:
        while True:
            msg = await self.request.receive()
            if msg["type"] == "http.disconnect":
                break
        if self.group is not None:
            self.group.fail(ClientGone())
            self.group.close()

    def error_of(self, o: OutRow) -> APIError | None:
        fr = o.finished_reason
        if not isinstance(fr, FINISH_ABORT) or (fr.status_code == 499 and not self.abort_is_error):
            return None
        return abort_error(fr)

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.cancel()
        if self.group is not None:
            self.group.close()

    async def wait_all(self) -> list[ReqState]:
        """Non-streaming: every request finished; an abort becomes its HTTP error."""
        assert self.group is not None
        try:
            async for _, o in self.group.outputs():
                err = self.error_of(o)
                if err is not None:
                    raise err  # the other choices of this request are aborted by close()
        except ServerDead as e:
            raise dead_error(e) from None
        finally:
            self.close()
        return self.group.states

    async def first_outputs(self) -> list[tuple[ReqState, OutRow]]:
        """Streaming: wait for each request's first output before the response starts, so a
        refusal (429, 400) is still an HTTP status and not an event inside a 200 stream."""
        assert self.group is not None
        items: list[tuple[ReqState, OutRow]] = []
        seen: set[str] = set()
        try:
            while len(seen) < len(self.group.states):
                st, o = await self.group.next()
                items.append((st, o))
                seen.add(st.rid)
                err = self.error_of(o)
                if err is not None:
                    raise err
        except ServerDead as e:
            self.close()
            raise dead_error(e) from None
        except BaseException:
            self.close()
            raise
        return items

    async def stream(self, first: list[tuple[ReqState, OutRow]]) -> AsyncIterator[tuple[ReqState, OutRow]]:
        assert self.group is not None
        for item in first:
            yield item
        async for item in self.group.outputs():
            yield item


def sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n".encode()


SSE_DONE = sse("[DONE]")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def stream_error(e: BaseException) -> bytes:
    if isinstance(e, APIError):
        return sse(e.to_json())
    if isinstance(e, ServerDead):
        return sse(dead_error(e).to_json())
    return sse(APIError(f"internal error: {e}", 500, "server_error", "internal_error").to_json())
