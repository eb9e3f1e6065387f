"""The FastAPI app: OpenAI endpoints, SGLang's native ones, admin and metrics.

Plain ASGI in front of the app (HTTP/2 probes, API keys, the body limit): server/frontend/guard.py.

``/openapi.json`` documents every route; the bodies the handlers parse themselves (``parse_body``,
so that errors keep OpenAI's shape) get their pydantic models' schemas (``_BODIES``).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp

from radixserve.auth import Access
from radixserve.server.frontend.admin_api import add_admin_routes
from radixserve.server.frontend.chat_protocol import ChatCompletionRequest
from radixserve.server.frontend.common import (
    dead_error,
    error_response,
)
from radixserve.server.frontend.guard import DEFAULT_MAX_BODY, Guard
from radixserve.server.frontend.native_api import add_native_routes
from radixserve.server.frontend.openai_api import OpenAIServing
from radixserve.server.frontend.protocol import (
    AbortRequest,
    APIError,
    CompletionRequest,
    GenerateRequest,
    SchedulePolicyRequest,
)
from radixserve.server.frontend.responses_api import ResponsesServing
from radixserve.server.frontend.responses_protocol import ResponsesRequest
from radixserve.server.frontend.tokenize_api import DetokenizeRequest, TokenizeRequest, add_tokenize_routes
from radixserve.server.frontend.tokenizer_manager import ServerDead, TokenizerManager

logger = logging.getLogger(__name__)

VERSION = "0.1.0"
HEALTH_GENERATE_TIMEOUT_S = 20.0


def create_app(tm: TokenizerManager, model_path: str, pids: dict[str, int]) -> ASGIApp:
    args = tm.args
    app = FastAPI(title="radixserve", version=VERSION, docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    openai = OpenAIServing(tm, {model_path, "default"})
    responses = ResponsesServing(openai)
    started = time.time()
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

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(response_id: str, limit: int = 20, order: str = "desc",
                                   after: str | None = None) -> dict[str, Any]:
        return responses.list_input_items(response_id, limit, order, after)

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

    add_native_routes(app, tm)
    add_admin_routes(app, tm, model_path, pids, VERSION)
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


def pid_map(procs: dict[str, Any]) -> dict[str, int]:
    return {"http": os.getpid(), **{name: p.pid for name, p in procs.items()}}
