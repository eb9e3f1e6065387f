"""Per-request scheduling fields from HTTP requests (docs/qos.md).

- tenant (vtc fairness): the ``x-tenant`` header, else the OpenAI ``user`` field (then its successor
  ``safety_identifier``) / native ``tenant``.
- TTFT deadline in ms: the ``x-ttft-slo-ms`` header, else the OpenAI ``ttft_slo_ms`` body field /
  the native ``deadline_ms`` field. The scheduler process turns it into ``Req.deadline`` =
  arrival (its clock) + ms / 1000.
- TPOT deadline in ms (mean time per output token after the first): the ``x-slo-tpot-ms`` header
  (llm-d's name), else the ``tpot_slo_ms`` body field (OpenAI and native). The scheduler process
  sets ``Req.tpot_slo`` (seconds); the scheduler keeps its batch small enough for it.
- ``data_parallel_rank`` (what a DP-aware router sends): validated against the server's data-parallel
  ranks, so a router that believes in a rank the server lacks gets a 400, not a silent reroute.
"""

from __future__ import annotations

import math
from typing import Any

from starlette.requests import Request

from radixserve.server.frontend.protocol import APIError


def _ms(value: Any, param: str) -> float | None:
    if value is None:
        return None
    try:
        ms = float(value)
    except (TypeError, ValueError):
        ms = -1.0
    if isinstance(value, bool) or not math.isfinite(ms) or ms <= 0:
        raise APIError(f"{param} must be a positive number of milliseconds, got {value!r}", param=param)
    return ms


SchedFields = tuple[str | None, float | None, int | None, float | None]


def sched_fields(request: Request, body: Any, openai: bool, dp_size: int = 1, pd_mode: str = "null") -> SchedFields:
    """(tenant, deadline_ms, data_parallel_rank, tpot_slo_ms) of one HTTP request: ``GenerateReq``'s
    fields in its order. ``pd_mode``: the server's ``--disaggregation-mode``."""
    extra = getattr(body, "model_extra", None) or {}
    # under prefill/decode disaggregation the router sends one body to both workers:
    # data_parallel_rank names the prefill worker's rank, data_parallel_rank_decode the decode worker's
    rank = extra.get("data_parallel_rank_decode") if pd_mode == "decode" else extra.get("data_parallel_rank")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < dp_size):
        raise APIError(f"data_parallel_rank must be an integer in [0, {dp_size}) (this server's dp_size is "
                       f"{dp_size}), got {rank!r}", param="data_parallel_rank")
    tenant = request.headers.get("x-tenant") or (
        (getattr(body, "user", None) or getattr(body, "safety_identifier", None)) if openai else extra.get("tenant"))
    if tenant is not None and not isinstance(tenant, str):
        raise APIError("tenant must be a string", param="tenant")
    tpot_header = request.headers.get("x-slo-tpot-ms")
    tpot = (_ms(tpot_header, "x-slo-tpot-ms") if tpot_header is not None
            else _ms(extra.get("tpot_slo_ms"), "tpot_slo_ms"))
    header = request.headers.get("x-ttft-slo-ms")
    if header is not None:
        return tenant, _ms(header, "x-ttft-slo-ms"), rank, tpot
    if openai:
        return tenant, _ms(extra.get("ttft_slo_ms"), "ttft_slo_ms"), rank, tpot
    return tenant, _ms(extra.get("deadline_ms"), "deadline_ms"), rank, tpot
