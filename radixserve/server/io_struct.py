"""Typed messages between the three server processes (msgpack via msgspec; no pickles).

    HTTP process (TokenizerManager) ──GenerateReq / AbortReq / ControlReq──> scheduler process
    scheduler process ──BatchOut──> detokenizer process ──BatchOut (+ texts)──> TokenizerManager
    scheduler process ──ControlReply / SchedulerStats / ProcReady──> TokenizerManager
    detokenizer process ──ProcReady──> TokenizerManager

With ``--dp-size N`` a data-parallel controller process sits where the scheduler was: it forwards
each ``GenerateReq`` to one of N scheduler processes and ``AbortReq`` / ``ControlReq`` to all of
them; each scheduler answers a ``ControlReq`` with its own ``ControlReply`` (tagged with its
rank) and reports its ``RankLoad`` to the controller after its steps.

One struct per message; every struct is tagged, so a socket decodes the union of what it may get.
The outputs are one record the whole way (``sched.io.BatchOut``), as are the sampling params
(``sched.sampling_params.SamplingParams``) and finish reasons (``sched.finish``).
"""

from __future__ import annotations

from typing import Any

import msgspec

from radixserve.sched.io import BatchOut
from radixserve.sched.sampling_params import SamplingParams


# --- HTTP process -> scheduler ---------------------------------------------------------------------
class GenerateReq(msgspec.Struct, tag=True):
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams  # validated by the HTTP process; the scheduler trusts them
    priority: int | None = None
    tenant: str | None = None  # vtc fairness
    deadline_ms: float | None = None  # TTFT deadline relative to arrival at the scheduler (edf)
    data_parallel_rank: int | None = None  # --dp-size: pins the request to this scheduler rank
    tpot_slo_ms: float | None = None  # TPOT deadline: mean ms per output token after the first
    stream: bool = True  # False: the scheduler sends the first token and the finish only
    bootstrap: Bootstrap | None = None  # prefill/decode disaggregation: the transfer this request is part of
    input_logprob_start: int | None = None  # prompt logprobs from this prompt token on (None: none)


class Bootstrap(msgspec.Struct):
    """The router's ``bootstrap_host`` / ``bootstrap_port`` / ``bootstrap_room`` (docs/scale-out.md);
    ``prefill_rank``: the prefill worker's data-parallel rank (its bootstrap server is port + rank)."""

    host: str
    port: int
    room: int
    prefill_rank: int = 0


class AbortReq(msgspec.Struct, tag=True):
    rid: str


class ControlReq(msgspec.Struct, tag=True):
    """``op``: flush_cache, get_load, memory, set_schedule_policy (with ``params``). Answered by a
    ``ControlReply`` with the same id."""

    req_id: int
    op: str
    params: dict[str, Any] | None = None


# --- scheduler -> HTTP process ---------------------------------------------------------------------
class ControlReply(msgspec.Struct, tag=True):
    req_id: int
    data: dict[str, Any]
    dp_rank: int = 0


class SchedulerStats(msgspec.Struct, tag=True):
    """Sent after every few steps and when the scheduler goes idle; feeds /metrics."""

    num_running_reqs: int
    num_queue_reqs: int
    num_used_tokens: int
    token_usage: float
    cache_hit_rate: float
    gen_throughput: float
    prompt_tokens: int  # cumulative counters from here on
    cached_tokens: int
    generated_tokens: int
    num_retractions: int
    forward_steps: int
    num_preemptions: int = 0  # priority preemptions, starved requests, deadline refusals
    num_starved: int = 0
    num_deadline_rejected: int = 0
    # speculative decoding, cumulative: request-steps that verified drafts, drafts, drafts accepted
    spec_verify_rows: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # the KV tier (--enable-hierarchical-cache): bytes it holds, and cumulative tokens it gave back,
    # loads, their seconds, bytes written and loaded, failed writes
    hicache_used_bytes: int = 0
    hicache_hit_tokens: int = 0
    hicache_loads: int = 0
    hicache_load_seconds: float = 0.0
    hicache_bytes_written: int = 0
    hicache_bytes_loaded: int = 0
    hicache_write_errors: int = 0
    # cumulative (priority, tenant, preemptions, retractions, starved) per class (sched/stats.py)
    by_class: list[tuple[str, str, int, int, int]] = []
    dp_rank: int = 0


# --- scheduler -> data-parallel controller ------------------------------------------------------------
class RankLoad(msgspec.Struct, tag=True):
    """A scheduler rank's load, sent to the controller when it changes (shortest_queue, minimum_tokens)."""

    dp_rank: int
    num_reqs: int  # running + waiting
    num_tokens: int  # KV slots in use plus prompt tokens still waiting


class ProcReady(msgspec.Struct, tag=True):
    """A child process finished starting (``error`` set: it failed and is exiting)."""

    name: str
    info: dict[str, Any] = {}
    error: str | None = None


class LoadProgress(msgspec.Struct, tag=True):
    """A stage of model loading done, for the progress bar of the HTTP process."""

    stage: str


ToScheduler = GenerateReq | AbortReq | ControlReq
ToController = GenerateReq | AbortReq | ControlReq | RankLoad
ToDetokenizer = BatchOut
ToTokenizerManager = BatchOut | ControlReply | SchedulerStats | ProcReady | LoadProgress


def decoder(union: Any) -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(union)


ENCODER = msgspec.msgpack.Encoder()
