"""The router's prefill/decode fields of a request body: ``bootstrap_host``, ``bootstrap_port``,
``bootstrap_room`` and ``data_parallel_rank``, the prefill worker's rank (the decode worker's own
rank is ``data_parallel_rank_decode``, ``sched_fields.py``). Validated here, so a malformed one is a
400, not a stuck room."""

from __future__ import annotations

from typing import Any

from radixserve.server.frontend.protocol import APIError
from radixserve.server.io_struct import Bootstrap


def bootstrap_fields(body: Any, mode: str) -> Bootstrap | None:
    extra = getattr(body, "model_extra", None) or {}
    room = extra.get("bootstrap_room")
    if room is None:
        return None
    if mode == "null":
        raise APIError("bootstrap_room is for prefill/decode disaggregation; this server runs with "
                       "--disaggregation-mode null", param="bootstrap_room")
    if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room < 2**63:
        raise APIError(f"bootstrap_room must be an integer in [0, 2**63), got {room!r}", param="bootstrap_room")
    host, port = extra.get("bootstrap_host"), extra.get("bootstrap_port")
    if mode == "decode":
        if not isinstance(host, str) or not host:
            raise APIError("a decode worker needs bootstrap_host (the prefill worker's host)", param="bootstrap_host")
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise APIError(f"bootstrap_port must be an integer in [1, 65535], got {port!r}", param="bootstrap_port")
    rank = extra.get("data_parallel_rank", 0)  # the prefill worker's rank: its bootstrap server is port + rank
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise APIError(f"data_parallel_rank must be an integer >= 0, got {rank!r}", param="data_parallel_rank")
    return Bootstrap(host if isinstance(host, str) else "", port if isinstance(port, int) else 0, room, rank)
