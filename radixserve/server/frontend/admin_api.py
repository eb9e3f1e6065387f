"""The admin and observability routes: server and model info (SGLang's names and their short
aliases), ``/flush_cache``, ``/abort_request``, ``/set_schedule_policy``, ``/get_load``,
``/debug/memory``, ``/metrics`` and the live dashboard (``scheduler/dashboard_state.py``, ``recent_requests.py``, docs/dashboard.md).
With ``--dp-size N`` every rank answers and the answers are merged."""

from __future__ import annotations

import dataclasses
import datetime
import time
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from radixserve import dashboard
from radixserve.server.cache_events import advertised_endpoints
from radixserve.server.frontend.common import error_response
from radixserve.server.frontend.protocol import AbortRequest, APIError, SchedulePolicyRequest, parse_body
from radixserve.server.frontend.tokenizer_manager import TokenizerManager
from radixserve.server.kv_events import advertised_kv_endpoint


def add_admin_routes(app: FastAPI, tm: TokenizerManager, model_path: str, pids: dict[str, int], version: str) -> None:
    _info_routes(app, tm, model_path, pids, version)
    _control_routes(app, tm)
    _dashboard_routes(app, tm, model_path, version)


def _info_routes(app: FastAPI, tm: TokenizerManager, model_path: str, pids: dict[str, int], version: str) -> None:
    args = tm.args
    # where a router subscribes to the ranks' cache events ([] when --cache-events-port is unset)
    cache_events = advertised_endpoints(args.host, args.cache_events_port, args.dp_size)
    kv_events = advertised_kv_endpoint(args.kv_events_config, args.host)  # vLLM's schema (rank 0)

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
            "version": version,
            **tm.info,
            "pids": pids,
            # what SGLang's gateway reads that our fields do not already say
            "context_length": tm.info.get("context_len"), "pp_size": 1, "is_embedding": False,
            "weight_version": "default",
            "cache_events_endpoint": cache_events[0] if cache_events else None,
            "cache_events_endpoints": cache_events,
            "kv_events_endpoint": kv_events,
        }
        info["internal_states"] = await tm.control("get_load")
        info["memory"] = merge_memory(await tm.control("memory"))
        tiers = await tm.control("kv_tier")  # per rank: the KV tier's figures (enabled False: none)
        info["kv_tier"] = tiers if any(t.get("enabled") for t in tiers) else None
        return info

    @app.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        return await server_info()

    @app.get("/server_info")
    async def server_info_alias() -> dict[str, Any]:
        return await server_info()

    def model_info() -> dict[str, Any]:
        """SGLang's model info (what its gateway reads to describe the model), and ours."""
        return {"model_path": model_path, "tokenizer_path": model_path, "is_generation": True,
                "model_type": tm.info.get("model_type"), "architectures": tm.info.get("architectures"),
                "has_image_understanding": False, "has_audio_understanding": False,
                "preferred_sampling_params": None, "weight_version": "default",
                "served_model_name": tm.model_name, "context_length": tm.context_len,
                "vocab_size": tm.info.get("vocab_size")}

    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        return model_info()

    @app.get("/model_info")
    async def model_info_alias() -> dict[str, Any]:
        return model_info()

    @app.get("/get_load")
    async def get_load() -> list[dict[str, Any]]:
        return await tm.control("get_load")

    @app.get("/v1/loads")
    async def loads() -> dict[str, Any]:
        return v1_loads(await tm.control("get_load"), tm, version)

    @app.get("/debug/memory")
    async def debug_memory() -> dict[str, Any]:
        return merge_memory(await tm.control("memory"))

    @app.get("/metrics")
    async def metrics() -> Response:
        if tm.metrics is None:
            raise APIError("metrics are off; start the server with --enable-metrics", 404, code="not_found")
        return Response(tm.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def _control_routes(app: FastAPI, tm: TokenizerManager) -> None:
    server_fields = {f.name for f in dataclasses.fields(tm.args)}

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
        """Switch the scheduling policy and/or its parameters live (docs/qos.md)."""
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


def _dashboard_routes(app: FastAPI, tm: TokenizerManager, model_path: str, version: str) -> None:
    """The live dashboard's page, its assets and the state it polls (``recent_requests.py``, ``scheduler/dashboard_state.py``)."""
    started = time.time()

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
        return {"kind": "server", "time": now, "uptime_s": now - started, "version": version,
                "model": tm.model_name, "model_path": model_path, "dp_size": tm.dp_size,
                "schedule_policy": ranks[0]["policy"], "policies": ranks[0]["policies"],
                "ranks": ranks, "requests": tm.recent_requests.summary()}


def merge_memory(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One ``/debug/memory`` answer for every data-parallel rank: sizes add up, the engine is idle
    and its invariant holds only if every rank's is; ``ranks`` keeps each rank's own answer."""
    if len(ranks) == 1:
        return ranks[0]
    out: dict[str, Any] = {k: sum(r[k] for r in ranks) for k in
                           ("total", "available", "evictable", "protected", "req_slots_free", "req_slots_total")}
    for key in ("kv_format", "kv_bytes_per_token"):  # the same on every rank
        if key in ranks[0]:
            out[key] = ranks[0][key]
    out["idle"] = all(r["idle"] for r in ranks)
    oks = [r["invariant_ok"] for r in ranks]
    out["invariant_ok"] = None if None in oks else all(oks)
    out["invariant_error"] = "; ".join(f"rank {i}: {r['invariant_error']}" for i, r in enumerate(ranks)
                                       if r["invariant_error"]) or None
    out["ranks"] = ranks
    return out


def v1_loads(ranks: list[dict[str, Any]], tm: TokenizerManager, version: str) -> dict[str, Any]:
    """SGLang's ``GET /v1/loads`` (what its gateway polls for load-aware routing): per data-parallel
    rank its running and waiting requests, KV tokens used of the pool, and the token usage."""
    pool = int(tm.info.get("max_total_num_tokens") or 0)
    out = []
    for r in ranks:
        waiting = int(r["num_waiting_reqs"])
        out.append({"dp_rank": r["dp_rank"], "num_running_reqs": int(r["num_reqs"]) - waiting,
                    "num_waiting_reqs": waiting, "num_used_tokens": r["num_used_tokens"],
                    "num_total_tokens": r["num_tokens"], "max_total_num_tokens": pool,
                    "max_running_requests": tm.info.get("max_running_requests"),
                    "token_usage": round(r["num_used_tokens"] / pool, 4) if pool else 0.0})
    return {"timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(), "version": version,
            "dp_rank_count": len(out), "loads": out}
