"""The FastAPI app: OpenAI endpoints, SGLang's native ones, admin and metrics.

Plain ASGI in front of the app (HTTP/2 probes, API keys, the body limit): server/guard.py.

``/openapi.json`` documents every route; the bodies the handlers parse themselves (``parse_body``,
so that errors keep OpenAI's shape) get their pydantic models' schemas (``_BODIES``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp

from radixserve import dashboard
from radixserve.auth import Access
from radixserve.sched.sampling_params import SamplingParams
from radixserve.server.cache_events import advertised_endpoints
from radixserve.server.common import (
    SSE_DONE,
    SSE_HEADERS,
    Call,
    check_prompt,
    dead_error,
    parse_sampling_params,
    sse,
    stream_error,
)
from radixserve.server.guard import DEFAULT_MAX_BODY, Guard
from radixserve.server.io_struct import GenerateReq
from radixserve.server.openai_api import OpenAIServing
from radixserve.server.pd_fields import bootstrap_fields
from radixserve.server.protocol import (
    AbortRequest,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    SchedulePolicyRequest,
    parse_body,
)
from radixserve.server.req_state import ReqState
from radixserve.server.responses_api import ResponsesServing
from radixserve.server.responses_protocol import ResponsesRequest
from radixserve.server.sched_fields import sched_fields
from radixserve.server.tokenize_api import DetokenizeRequest, TokenizeRequest, add_tokenize_routes
from radixserve.server.tokenizer_manager import ClientGone, ServerDead, TokenizerManager

logger = logging.getLogger(__name__)

VERSION = "0.1.0"
HEALTH_GENERATE_TIMEOUT_S = 20.0


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.to_json(), status_code=e.status_code, headers=e.headers)


def create_app(tm: TokenizerManager, model_path: str, pids: dict[str, int]) -> ASGIApp:
    args = tm.args
    app = FastAPI(title="radixserve", version=VERSION, docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    openai = OpenAIServing(tm, {model_path, "default"})
    responses = ResponsesServing(openai)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(ServerDead)
    async def _dead(request: Request, e: ServerDead) -> JSONResponse:
        return error_response(dead_error(e))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "http_error")
        return error_response(APIError(str(e.detail), e.status_code, "invalid_request_error", code))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError) -> JSONResponse:
        return error_response(APIError(f"invalid request: {e.errors()[:1]}", 400))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        logger.exception("internal error on %s", request.url.path)
        return error_response(APIError(f"internal error: {e}", 500, "server_error", "internal_error"))

    # --- OpenAI ----------------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await openai.chat(request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await openai.completions(request)

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        return await responses.create(request)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict[str, Any]:
        return responses.retrieve(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        return responses.delete(response_id)

    def model_card() -> dict[str, Any]:
        return {"id": tm.model_name, "object": "model", "created": int(started), "owned_by": "radixserve",
                "root": model_path, "max_model_len": tm.context_len}

    add_tokenize_routes(app, tm, openai.check_model)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        openai.check_model(model_id)
        return model_card()

    # --- native ------------------------------------------------------------------------------------
    @app.post("/generate")
    async def generate(request: Request) -> Response:
        body = parse_body(await request.body(), GenerateRequest)
        return await _native_generate(tm, request, body)

    @app.get("/health")
    async def health() -> Response:
        if not tm.alive():
            return error_response(APIError(tm.dead or "a server process died", 503, "server_error",
                                           "server_unavailable"))
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        if not tm.alive():
            return error_response(APIError(tm.dead or "a server process died", 503, "server_error",
                                           "server_unavailable"))
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

    server_fields = {f.name for f in dataclasses.fields(tm.args)}
    # where a router subscribes to the ranks' cache events ([] when --cache-events-port is unset)
    cache_events = advertised_endpoints(args.host, args.cache_events_port, args.dp_size)

    async def server_info() -> dict[str, Any]:
        cfg = dataclasses.asdict(tm.args)
        for secret in ("api_key", "admin_api_key"):
            if cfg.get(secret):
                cfg[secret] = "***"
        info = {
            **cfg,
            "model_path": model_path,
            "served_model_name": tm.model_name,
            "dp_size": args.dp_size,
            "tp_size": getattr(args, "tp_size", 1),
            "version": VERSION,
            **tm.info,
            "pids": pids,
            "cache_events_endpoint": cache_events[0] if cache_events else None,
            "cache_events_endpoints": cache_events,
        }
        info["internal_states"] = await tm.control("get_load")
        info["memory"] = merge_memory(await tm.control("memory"))
        return info

    @app.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        return await server_info()

    @app.get("/server_info")
    async def server_info_alias() -> dict[str, Any]:
        return await server_info()

    def model_info() -> dict[str, Any]:
        return {"model_path": model_path, "tokenizer_path": model_path, "is_generation": True,
                "served_model_name": tm.model_name, "context_length": tm.context_len,
                "vocab_size": tm.info.get("vocab_size")}

    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        return model_info()

    @app.get("/model_info")
    async def model_info_alias() -> dict[str, Any]:
        return model_info()

    async def flush_cache() -> Response:
        ok = all(r.get("success", False) for r in await tm.control("flush_cache"))
        if not ok:
            return error_response(APIError("Cache not flushed: requests are running; retry when idle.", 400,
                                           code="server_busy"))
        return JSONResponse({"success": True, "message": "Cache flushed."})

    # two routes, not one with two methods: OpenAPI operation ids must be unique per method
    app.get("/flush_cache")(flush_cache)
    app.post("/flush_cache")(flush_cache)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> dict[str, Any]:
        body = parse_body(await request.body(), AbortRequest)
        rids = list(tm.groups) if body.abort_all else [body.rid]
        found = [r for r in rids if r in tm.groups]
        for r in found:
            tm.abort(r)
        return {"success": bool(found), "aborted": found}

    @app.post("/set_schedule_policy")
    async def set_schedule_policy(request: Request) -> Response:
        """Switch the scheduling policy and/or its parameters live (docs/scheduling.md)."""
        raw = await request.body()
        params = parse_body(raw, SchedulePolicyRequest).model_dump(exclude_unset=True) if raw.strip() else None
        if not params:
            raise APIError('the body must be a JSON object such as {"schedule_policy": "lpm"}', code="invalid_json")
        replies = await tm.control("set_schedule_policy", params)
        failed = next((r for r in replies if not r.get("success")), None)
        if failed is not None:
            raise APIError(str(failed.get("message") or failed.get("error")), code="invalid_schedule_policy")
        # keep /get_server_info true to what the scheduler now runs
        live = {k: v for k, v in (replies[0].get("params") or {}).items() if k in server_fields}
        try:
            tm.args = tm.args.replace(**{"schedule_policy": replies[0]["schedule_policy"], **live})
        except ValueError:  # a policy only the scheduler process knows (a plugin): keep the rest true
            pass
        return JSONResponse(replies[0])

    @app.get("/get_load")
    async def get_load() -> list[dict[str, Any]]:
        return await tm.control("get_load")

    @app.get("/debug/memory")
    async def debug_memory() -> dict[str, Any]:
        return merge_memory(await tm.control("memory"))

    @app.get("/metrics")
    async def metrics() -> Response:
        if tm.metrics is None:
            raise APIError("metrics are off; start the server with --enable-metrics", 404, code="not_found")
        return Response(tm.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    # --- the live dashboard (server/dashboard.py, docs/dashboard.md) -------------------------------
    @app.get("/dashboard")
    async def dashboard_page() -> Response:
        return Response(dashboard.read(dashboard.PAGE), media_type="text/html; charset=utf-8",
                        headers={"Cache-Control": "no-cache"})

    @app.get("/dashboard/static/{name}")
    async def dashboard_asset(name: str) -> Response:
        if name not in dashboard.ASSETS:
            raise APIError(f"no dashboard file {name!r}", 404, code="not_found")
        return Response(dashboard.read(name), media_type=dashboard.ASSETS[name], headers={"Cache-Control": "no-cache"})

    @app.get("/dashboard/state")
    async def dashboard_state() -> dict[str, Any]:
        ranks = await tm.control("dashboard")
        now = time.time()
        return {"kind": "server", "time": now, "uptime_s": now - started, "version": VERSION,
                "model": tm.model_name, "model_path": model_path, "dp_size": tm.dp_size,
                "schedule_policy": ranks[0]["policy"], "policies": ranks[0]["policies"],
                "ranks": ranks, "requests": tm.recent_requests.summary()}

    started = time.time()
    access = Access(args.api_key, getattr(args, "admin_api_key", None))
    return Guard(app, access, getattr(args, "max_request_body_bytes", DEFAULT_MAX_BODY))


# the routes whose handlers parse their bodies themselves (parse_body): their request schemas
_BODIES: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/responses": ResponsesRequest,
    "/generate": GenerateRequest,
    "/abort_request": AbortRequest,
    "/set_schedule_policy": SchedulePolicyRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error: OpenAI's shape."""

    error: ErrorBody


def _openapi(app: FastAPI) -> dict[str, Any]:
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                         description="radixserve: OpenAI-compatible and SGLang-native endpoints (docs/api.md).")
    models: list[type[BaseModel]] = [*_BODIES.values(), ErrorResponse]
    _, defs = models_json_schema([(m, "validation") for m in models], ref_template="#/components/schemas/{model}")
    schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
    err = {"description": "Error (OpenAI's shape)",
           "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    for path, ops in schema.get("paths", {}).items():
        for method, op in ops.items():
            op.setdefault("responses", {})
            for code in ("400", "401", "404") if method == "post" else ("401",):
                op["responses"].setdefault(code, err)
            model = _BODIES.get(path)
            if model is not None and method == "post":
                op["requestBody"] = {"required": path != "/abort_request", "content": {"application/json": {
                    "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
                op["responses"]["413"] = err
                if path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/generate"):
                    op["responses"]["200"]["content"]["text/event-stream"] = {"schema": {"type": "string"}}
    app.openapi_schema = schema
    return schema


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
        reqs.append(GenerateReq(rid, ids, params, body.priority, *fields, stream=bool(body.stream),
                                bootstrap=bootstrap_fields(body, tm.args.disaggregation_mode)))
    call = Call(tm, request, abort_is_error=False)
    await call.open(reqs)
    if body.stream:
        first = await call.first_outputs()
        return StreamingResponse(_native_stream(call, first, body.return_logprob), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    try:
        states = await call.wait_all()
    except ClientGone:
        return Response(status_code=499)
    outs = [_native_result(st, body.return_logprob) for st in states]
    return JSONResponse(outs[0] if single else outs)


def _native_result(st: ReqState, logprob: bool) -> dict[str, Any]:
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
    }
    if logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(st.logprobs, st.output_ids, strict=False)]
        meta["output_top_logprobs"] = [[[v, t, None] for t, v in top] for top in st.top_logprobs]
    return {"text": st.text, "output_ids": list(st.output_ids), "meta_info": meta}


async def _native_stream(call: Call, first: list[tuple[ReqState, Any]], logprob: bool) -> AsyncIterator[bytes]:
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


def merge_memory(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One ``/debug/memory`` answer for every data-parallel rank: sizes add up, the engine is idle
    and its invariant holds only if every rank's is; ``ranks`` keeps each rank's own answer."""
    if len(ranks) == 1:
        return ranks[0]
    out: dict[str, Any] = {k: sum(r[k] for r in ranks) for k in
                           ("total", "available", "evictable", "protected", "req_slots_free", "req_slots_total")}
    out["idle"] = all(r["idle"] for r in ranks)
    oks = [r["invariant_ok"] for r in ranks]
    out["invariant_ok"] = None if None in oks else all(oks)
    out["invariant_error"] = "; ".join(f"rank {i}: {r['invariant_error']}" for i, r in enumerate(ranks)
                                       if r["invariant_error"]) or None
    out["ranks"] = ranks
    return out


def pid_map(procs: dict[str, Any]) -> dict[str, int]:
    return {"http": os.getpid(), **{name: p.pid for name, p in procs.items()}}
