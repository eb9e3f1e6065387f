"""SGLang's native generation routes: ``POST /generate`` (text or token ids, one prompt or a batch,
streamed or not, SGLang's ``meta_info``), ``GET /health`` and ``GET /health_generate``."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from radixserve.model.tokenizer import Tokenizer
from radixserve.sched.io import spec_meta
from radixserve.sched.sampling_params import SamplingParams
from radixserve.server.frontend.common import (
    SSE_DONE,
    SSE_HEADERS,
    Call,
    check_prompt,
    error_response,
    input_logprob_start,
    parse_sampling_params,
    resolve_max_tokens,
    sse,
    stream_error,
)
from radixserve.server.frontend.pd_fields import bootstrap_fields
from radixserve.server.frontend.protocol import APIError, GenerateRequest, parse_body
from radixserve.server.frontend.req_state import ReqState
from radixserve.server.frontend.sched_fields import sched_fields
from radixserve.server.frontend.tokenizer_manager import ClientGone, TokenizerManager
from radixserve.server.io_struct import GenerateReq

HEALTH_GENERATE_TIMEOUT_S = 20.0


def add_native_routes(app: FastAPI, tm: TokenizerManager) -> None:
    @app.post("/generate")
    async def generate(request: Request) -> Response:
        body = parse_body(await request.body(), GenerateRequest)
        return await _native_generate(tm, request, body)

    def unhealthy() -> Response | None:
        if not tm.alive():
            return error_response(APIError(tm.dead or "a server process died", 503, "server_error",
                                           "server_unavailable"))
        if tm.draining:
            return error_response(APIError("draining: shutting down after the requests in flight", 503,
                                           "server_error", "server_draining"))
        return None

    @app.get("/health")
    async def health() -> Response:
        return unhealthy() or Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        bad = unhealthy()
        if bad is not None:
            return bad
        ids = tm.tokenizer.encode("Hello") or [0]
        req = GenerateReq(f"HEALTH_CHECK_{uuid.uuid4().hex}", ids, SamplingParams(max_new_tokens=1, temperature=0.0))
        call = Call(tm, request)
        await call.open([req])
        try:
            states = await asyncio.wait_for(call.wait_all(), HEALTH_GENERATE_TIMEOUT_S)
        except asyncio.TimeoutError:
            return error_response(APIError("health generation timed out", 503, "server_error", "timeout"))
        finally:
            call.close()
        return JSONResponse({"ok": True, "output_ids": states[0].output_ids})


async def _native_generate(tm: TokenizerManager, request: Request, body: GenerateRequest) -> Response:
    if (body.text is None) == (body.input_ids is None):
        raise APIError("pass exactly one of text or input_ids", param="text")
    single = isinstance(body.text, str) or (body.input_ids is not None and
                                            (not body.input_ids or not isinstance(body.input_ids[0], list)))
    if body.text is not None:
        texts = [body.text] if isinstance(body.text, str) else body.text
        prompts = [tm.tokenizer.encode(t) for t in texts]
        param = "text"
    else:
        assert body.input_ids is not None
        prompts = [list(body.input_ids)] if single else [list(x) for x in body.input_ids]  # type: ignore[arg-type]
        param = "input_ids"
    if not prompts:
        raise APIError("no prompt given", param=param)
    sps = body.sampling_params if isinstance(body.sampling_params, list) else [body.sampling_params or {}] * len(prompts)
    if len(sps) != len(prompts):
        raise APIError("one sampling_params per prompt, or a single object for all", param="sampling_params")
    if isinstance(body.rid, list):
        rids = body.rid
    elif body.rid is not None:
        rids = [body.rid] if single else [f"{body.rid}-{i}" for i in range(len(prompts))]
    else:
        rids = [uuid.uuid4().hex for _ in prompts]
    if len(rids) != len(prompts):
        raise APIError("one rid per prompt", param="rid")
    if body.stream and not single:
        raise APIError("streaming takes a single prompt", param="stream")
    reqs = []
    fields = sched_fields(request, body, openai=False, dp_size=tm.dp_size, pd_mode=tm.args.disaggregation_mode)
    for ids, sp, rid in zip(prompts, sps, rids, strict=True):
        check_prompt(tm, ids, param)
        sp = dict(sp)
        if body.return_logprob:
            sp.setdefault("logprobs", True)
            sp.setdefault("top_logprobs_num", body.top_logprobs_num)
        params = parse_sampling_params(sp, tm.info.get("vocab_size"), openai=False)
        params.max_new_tokens = resolve_max_tokens(tm, len(ids), params.max_new_tokens, param, clip=True,
                                                   param="max_new_tokens")
        start = (input_logprob_start(tm, body.logprob_start_len, len(ids), "logprob_start_len")
                 if body.return_logprob else None)
        reqs.append(GenerateReq(rid, ids, params, body.priority, *fields, stream=bool(body.stream),
                                bootstrap=bootstrap_fields(body, tm.args.disaggregation_mode),
                                input_logprob_start=start))
    lp = _LogprobEntries(tm.tokenizer, body.return_text_in_logprobs) if body.return_logprob else None
    call = Call(tm, request, abort_is_error=False)
    await call.open(reqs)
    if body.stream:
        first = await call.first_outputs()
        return StreamingResponse(_native_stream(call, first, lp), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    try:
        states = await call.wait_all()
    except ClientGone:
        return Response(status_code=499)
    outs = [_native_result(st, lp) for st in states]
    return JSONResponse(outs[0] if single else outs)


class _LogprobEntries:
    """SGLang's logprob entries: ``[logprob, token_id, text]``, the text only when asked for."""

    def __init__(self, tokenizer: Tokenizer, with_text: bool) -> None:
        self.tokenizer = tokenizer
        self.with_text = with_text

    def entry(self, lp: float | None, tid: int) -> list[Any]:
        return [lp, tid, self.tokenizer.decode([tid], False) if self.with_text else None]

    def add(self, meta: dict[str, Any], st: ReqState) -> None:
        e = self.entry
        meta["output_token_logprobs"] = [e(lp, t) for lp, t in zip(st.logprobs, st.output_ids, strict=False)]
        meta["output_top_logprobs"] = [[e(v, t) for t, v in top] for top in st.top_logprobs]
        p = st.input_logprobs
        if p is None:
            meta["input_token_logprobs"], meta["input_top_logprobs"] = [], []
            return
        meta["input_token_logprobs"] = [e(lp, t) for lp, t in zip(p.logprobs, p.token_ids, strict=True)]
        meta["input_top_logprobs"] = [None if top is None else [e(v, t) for t, v in top] for top in p.top_logprobs]


def _native_result(st: ReqState, logprob: _LogprobEntries | None) -> dict[str, Any]:
    o = st.last
    assert o is not None
    meta: dict[str, Any] = {
        "id": st.rid,
        "prompt_tokens": o.prompt_tokens,
        "completion_tokens": o.completion_tokens,
        "cached_tokens": o.cached_tokens,
        "finish_reason": o.finished_reason.to_json() if o.finished_reason else None,
        "e2e_latency": time.perf_counter() - st.created,
        "ttft": st.ttft,
        "queue_time": o.queue_time,
        "num_retractions": o.num_retractions,
        "dp_rank": o.dp_rank,
        **spec_meta(st.spec),
    }
    if logprob is not None:
        logprob.add(meta, st)
    return {"text": st.text, "output_ids": list(st.output_ids), "meta_info": meta}


async def _native_stream(call: Call, first: list[tuple[ReqState, Any]], logprob: _LogprobEntries | None) -> AsyncIterator[bytes]:
    try:
        async for st, o in call.stream(first):
            err = call.error_of(o)
            if err is not None:
                yield stream_error(err)
                break
            yield sse(_native_result(st, logprob))
        yield SSE_DONE
    except ClientGone:
        return
    except Exception as e:
        yield stream_error(e)
        yield SSE_DONE
    finally:
        call.close()
