"""The simulation loop: the real scheduler, radix cache and allocators over a cost-model runner.

``SimRunner`` is a ``Runner``: ``forward(batch)`` advances a ``VirtualClock`` by the cost model's
step time and returns one next token per request: the request's own token stream until it reaches
its pre-sampled output length, then EOS. Everything above ``forward`` is the engine's own code:
``build_scheduler`` (sglang or unified), ``PrefillAdder``, the policies, ``KVManager``,
``RadixCache``/``ChunkCache``, ``TokenToKVPoolAllocator`` and ``ReqToTokenPool``.
"""

from __future__ import annotations

import math
import random
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from radixserve.config import ServerArgs
from radixserve.config.speculative import DRAFT_MODEL_ALGORITHMS
from radixserve.mem.cache_events import CacheEvent
from radixserve.mem.draft_tree import depths, walk
from radixserve.mem.forward_batch import ForwardBatch, ForwardOutput
from radixserve.mem.kv_pool import ReqToTokenPool
from radixserve.sched.build import build_kv, build_scheduler
from radixserve.sched.core import SchedulerCore
from radixserve.sched.finish import FINISH_ABORT
from radixserve.sched.io import BatchOut
from radixserve.sched.req import Req
from radixserve.sched.request_checks import check_request
from radixserve.sched.sampling_params import SamplingParams
from radixserve.sched.spec import spec_counts
from radixserve.sim.cost_model import CostModel
from radixserve.sim.host_tier import attach_host_tier, tier_figures
from radixserve.sim.workload import EOS_TOKEN_ID, RequestSpec, stream_token

_ENCODER = msgspec.msgpack.Encoder()

VOCAB_SIZE = 32000


class VirtualClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class NoWriteReqToTokenPool(ReqToTokenPool):
    """``--skip-req-to-token-writes``: a ReqToTokenPool without its [size, context] table. Only a
    model's attention reads the table, so the simulator may skip the per-request ``torch.tensor``
    writes (the top hot spot at 1,000 running; a GPU engine writes it in one kernel per batch)."""

    def __init__(self, size: int, max_context_len: int) -> None:
        super().__init__(size, 1)
        self.max_context_len = max_context_len

    def write(self, idx: int, start: int, slots: Sequence[int]) -> None:
        return None

    def write_many(self, rows: list[int], cols: list[int], slots: list[int]) -> None:
        return None


class SimRunner:
    """The model, simulated: step time from ``cost``; each request's tokens from its stream, EOS at
    its sampled length. Like the model runner it sees only ``forward(batch)``: a request is known by
    the id the batch carries, from ``expect`` (called when the request is submitted)."""

    def __init__(self, cost: CostModel, clock: VirtualClock) -> None:
        self.cost = cost
        self.clock = clock
        self.expected: dict[str, tuple[int, int, int]] = {}  # rid -> (output length, stream, offset)
        self.wall = 0.0  # wall seconds spent in forward (excluded from the scheduler's overhead)
        self.cpu = 0.0  # process CPU seconds spent in forward (likewise)
        self.busy = 0.0  # virtual seconds of modelled GPU time

    def expect(self, spec: RequestSpec) -> None:
        self.expected[spec.rid] = (spec.output_len, spec.stream, spec.stream_offset)

    def forget(self, rid: str) -> None:
        """The request ended (finished, aborted or refused): it will not be forwarded again."""
        self.expected.pop(rid, None)

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        t0, c0 = time.perf_counter(), time.process_time()
        dt = self.cost.step_time(batch.extend_prefix_lens, batch.extend_seq_lens)
        drafts = None
        if batch.verify is not None and batch.verify.by_runner:
            drafts, draft_s = self._draft(batch)
            dt += draft_s
        self.clock.now += dt
        self.busy += dt
        out = []
        for rid, k in zip(batch.rids, batch.sampling.steps, strict=True):  # k: tokens generated so far
            out.append(self._token(rid, k))
        result = ForwardOutput(next_token_ids=out)
        if batch.verify is not None:  # a draft is right where it is the request's own next token
            v = batch.verify
            if v.parents is None:
                result.verified = [[self._token(batch.rids[row], batch.sampling.steps[row] + j) for j in range(len(d) + 1)]
                                   for row, d in zip(v.rows, v.drafts, strict=True)]
            else:  # a draft tree: the walk down it, by each node's depth
                walks = [self._walk(batch.rids[row], batch.sampling.steps[row], d, p)
                         for row, d, p in zip(v.rows, v.drafts, v.parents, strict=True)]
                result.verified = [t + [-1] * (len(d) + 1 - len(t)) for (t, _), d in zip(walks, v.drafts, strict=True)]
                result.verify_paths = [path for _, path in walks]
            result.drafts = drafts
        self.wall += time.perf_counter() - t0
        self.cpu += time.process_time() - c0
        return result

    def _draft(self, batch: ForwardBatch) -> tuple[list[list[int]], float]:
        """The simulated draft model's tokens for the verify rows (each the request's own next
        token with probability ``acceptance``, else another) and the seconds its forwards take."""
        model = self.cost.draft
        assert batch.verify is not None and model is not None
        drafts = []
        for row, d in zip(batch.verify.rows, batch.verify.drafts, strict=True):
            rid, k = batch.rids[row], batch.sampling.steps[row]
            made = []
            for j in range(len(d)):
                true = self._token(rid, k + j)
                hit = random.Random(zlib.crc32(f"{rid}:{k + j}".encode())).random() < model.acceptance
                made.append(true if hit else true + 1)
            drafts.append(made)
        steps = max(len(d) for d in batch.verify.drafts)
        decode = self.cost.step_time(batch.extend_prefix_lens, [1] * len(batch.extend_seq_lens))
        return drafts, steps * model.cost * decode

    def _walk(self, rid: str, k: int, draft: list[int], parents: list[int]) -> tuple[list[int], list[int]]:
        deep = [0, *depths(parents)]
        return walk(parents, draft, lambda j, _: self._token(rid, k + deep[j]))

    def _token(self, rid: str, k: int) -> int:
        """Request ``rid``'s output token ``k``."""
        output_len, stream, offset = self.expected[rid]
        return EOS_TOKEN_ID if k + 1 >= output_len else stream_token(stream, offset + k)


def build_sim_scheduler(
    args: ServerArgs, cost: CostModel, context_len: int, clock: VirtualClock | None = None,
    skip_req_to_token_writes: bool = False, event_sink: Callable[[CacheEvent], None] | None = None,
) -> tuple[SchedulerCore, SimRunner, VirtualClock]:
    """The engine's pools, cache and scheduler (as ``serving_build.build_scheduler``) without a model."""
    clock = clock or VirtualClock()
    if (args.speculative_algorithm or "").lower() in DRAFT_MODEL_ALGORITHMS and cost.draft is None:
        raise ValueError("--speculative-algorithm draft in the simulator needs a simulated draft model "
                         "(the cost model's draft: --draft-acceptance and --draft-cost)")
    if args.max_total_tokens is None:
        raise ValueError("the simulator needs --max-total-tokens (KV pool size in tokens)")
    kv = build_kv(args, args.max_total_tokens, context_len,
                  pool_cls=NoWriteReqToTokenPool if skip_req_to_token_writes else ReqToTokenPool,
                  event_sink=event_sink)
    if args.enable_hierarchical_cache:
        attach_host_tier(args, kv, cost, clock, event_sink)
    runner = SimRunner(cost, clock)
    sched = build_scheduler(args, runner, kv, context_len=context_len, vocab_size=None,
                            eos_token_ids=[EOS_TOKEN_ID], clock=clock)
    return sched, runner, clock


def make_req(spec: RequestSpec, stream: bool = False) -> Req:
    sp = SamplingParams(max_new_tokens=max(spec.output_len, 1), ignore_eos=False)
    req = Req(spec.rid, spec.prompt_ids(), sp, arrival_time=spec.arrival_time, priority=spec.priority,
              eos_token_ids=(EOS_TOKEN_ID,), stream=stream)
    if spec.tenant is not None:
        req.tenant = spec.tenant  # read by tenant-aware policies
    if spec.deadline_ms is not None:
        req.deadline = spec.arrival_time + spec.deadline_ms / 1e3
    if spec.tpot_slo_ms is not None:
        req.tpot_slo = spec.tpot_slo_ms / 1e3
    return req


def submit(sched: SchedulerCore, req: Req) -> None:
    """Hand ``req`` to the scheduler as an engine's edge does: checked first (``request_checks``);
    one that cannot run here is finished at once with the reason."""
    err = check_request(req, sched.limits())
    if err is None:
        sched.add_request(req)
    else:
        sched.finish(req, err)


@dataclass
class ReqRecord:
    priority: int | None
    tenant: str | None
    prompt_len: int
    output_len: int
    cached_tokens: int
    ttft: float  # nan when no token was produced
    e2e: float
    tpot: float  # nan for one-token outputs
    queue: float  # arrival -> first scheduled (nan if never scheduled)
    retractions: int
    preemptions: int
    aborted: bool
    deadline: float | None  # TTFT deadline in seconds after arrival
    arrival: float = 0.0  # virtual seconds
    predicted_ttft: float | None = None  # --deadline-admission's prediction at arrival (seconds)
    tpot_deadline: float | None = None  # TPOT deadline in seconds per output token


@dataclass
class SimTrace:
    """Raw outcome of one run; ``summarize`` turns it into the result dict."""

    label: str
    records: list[ReqRecord] = field(default_factory=list)
    timeline: list[tuple[float, float, int, int]] = field(default_factory=list)  # (t, kv usage, running, waiting)
    step_sched_s: list[float] = field(default_factory=list)  # scheduler wall seconds per step (forward excluded)
    step_sched_cpu_s: list[float] = field(default_factory=list)  # scheduler process CPU seconds per step (likewise)
    step_forward_s: list[float] = field(default_factory=list)  # the cost model's forward seconds per step
    overlap: bool = False  # the loop overlaps scheduling with the forward (what --overlap-schedule auto means here)
    step_running: list[int] = field(default_factory=list)
    step_waiting: list[int] = field(default_factory=list)
    duration: float = 0.0
    gpu_busy: float = 0.0
    wall_s: float = 0.0
    cpu_s: float = 0.0  # process CPU seconds of the whole run
    prefill_estimate: list[float] = field(default_factory=list)  # --deadline-admission's tokens/s after each step
    stats: dict[str, Any] = field(default_factory=dict)
    truncated: bool = False  # stopped at max_steps with requests unfinished


def _record(req: Req) -> ReqRecord:
    arr = req.arrival_time
    ft, fin = req.first_token_time, req.finished_time or arr
    n = len(req.output_ids)
    ttft = ft - arr if ft is not None else math.nan
    tpot = (fin - ft) / (n - 1) if ft is not None and n > 1 else math.nan
    queue = req.first_scheduled_time - arr if req.first_scheduled_time is not None else math.nan
    dl = getattr(req, "deadline", None)
    return ReqRecord(req.priority, getattr(req, "tenant", None), req.prompt_len, n, req.cached_tokens, ttft,
                     fin - arr, tpot, queue, req.num_retractions, req.num_preemptions,
                     isinstance(req.finished_reason, FINISH_ABORT), None if dl is None else dl - arr, arr,
                     getattr(req, "predicted_ttft", None), req.tpot_slo)


def run(
    args: ServerArgs,
    specs: Sequence[RequestSpec],
    cost: CostModel,
    context_len: int,
    label: str = "",
    progress: bool = False,
    max_timeline: int = 4000,
    check_invariant: bool = True,
    on_step: Callable[[SchedulerCore], None] | None = None,
    skip_req_to_token_writes: bool = False,
    max_steps: int | None = None,
    stream: bool = False,
    charge_scheduler_time: bool = False,
) -> SimTrace:
    """Feed ``specs`` to a fresh scheduler at their arrival times and step it until all finish
    (or until ``max_steps`` forward steps: then unfinished requests are left out of the results).
    ``stream``: the requests stream (the scheduler emits every token of every request every step);
    otherwise they are non-streaming calls, whose tokens go out with the first and the last.
    ``charge_scheduler_time``: the scheduler's measured wall time per step advances the virtual clock
    too: all of it under the normal loop, only what the forward does not cover under the overlap
    loop (which schedules the next step while the forward runs)."""
    sched, runner, clock = build_sim_scheduler(args, cost, context_len,
                                               skip_req_to_token_writes=skip_req_to_token_writes)
    trace = SimTrace(label or args.schedule_policy, overlap=sched.overlap_enabled())
    live: dict[str, Req] = {}
    n, i = len(specs), 0
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=n, desc=f"simulate {trace.label}", unit="req", mininterval=0.5)
    step = _Stepper(sched, runner, clock, trace, charge_scheduler_time, args.deadline_admission)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    stuck = 0
    while i < n or sched.has_work():
        if max_steps is not None and len(trace.step_sched_s) >= max_steps:
            trace.truncated = True
            break
        if i < n and not sched.has_work() and specs[i].arrival_time > clock.now:
            clock.now = specs[i].arrival_time  # idle: jump to the next arrival
        while i < n and specs[i].arrival_time <= clock.now:
            req = make_req(specs[i], stream)
            live[req.rid] = req
            runner.expect(specs[i])
            submit(sched, req)
            i += 1
        outs = step()
        if sched.cur_batch is not None:
            stuck = 0
        elif sched.has_work():
            stuck += 1
            if (wake := _next_event(specs, i, sched)) is not None:
                clock.now = max(clock.now, wake)
            elif stuck > 3:
                raise RuntimeError(f"the scheduler has work but schedules nothing ({len(sched.queues.waiting)} waiting)")
        for rid in _finished(outs):
            done_req = live.pop(rid, None)
            if done_req is None:
                continue
            runner.forget(rid)
            trace.records.append(_record(done_req))
            if bar is not None:
                bar.update(1)
                if len(trace.records) % 500 == 0:
                    bar.set_postfix_str(f"virtual {clock.now:.1f} s, {len(sched.queues.running.reqs)} running, "
                                        f"{len(sched.queues.waiting)} waiting", refresh=False)
        if on_step is not None:
            on_step(sched)
    if not trace.truncated:
        sched.step()  # the idle step (runs the scheduler's own self-check when --idle-self-check)
        if check_invariant:
            sched.kv.check_invariant()
    if bar is not None:
        bar.close()
    trace.wall_s = time.perf_counter() - wall0
    trace.cpu_s = time.process_time() - cpu0
    _close_trace(trace, sched, runner, clock, max_timeline)
    return trace


def _next_event(specs: Sequence[RequestSpec], i: int, sched: SchedulerCore) -> float | None:
    """When an idle scheduler has something to do again: the next arrival, or a prefix arriving from
    the host tier, whichever is first (None: neither is coming)."""
    times = [t for t in (specs[i].arrival_time if i < len(specs) else None, sched.kv.next_load_time())
             if t is not None]
    return min(times) if times else None


def _finished(outs: BatchOut) -> list[str]:
    return [rid for rid, reason in zip(outs.rids, outs.finished_reasons, strict=True) if reason is not None]


class _Stepper:
    """One scheduler step under the simulator, measured: the scheduler's own wall and CPU time (the
    forward's excluded), optionally charged to the virtual clock, and the step's queue sizes."""

    def __init__(self, sched: SchedulerCore, runner: SimRunner, clock: VirtualClock, trace: SimTrace,
                 charge_scheduler_time: bool, deadline_admission: bool) -> None:
        self.sched, self.runner, self.clock, self.trace = sched, runner, clock, trace
        self.charge = charge_scheduler_time
        self.estimator = sched.deadlines.throughput if deadline_admission else None

    def __call__(self) -> BatchOut:
        sched, runner, clock, trace = self.sched, self.runner, self.clock, self.trace
        fwd0, fwd_cpu0, busy0 = runner.wall, runner.cpu, runner.busy
        t0, c0 = time.perf_counter(), time.process_time()
        outs = sched.step()
        _ENCODER.encode(outs)  # what the scheduler process does with them: part of its time per step
        spent = time.perf_counter() - t0 - (runner.wall - fwd0)
        spent_cpu = time.process_time() - c0 - (runner.cpu - fwd_cpu0)
        if sched.cur_batch is None:
            return outs
        fwd = runner.busy - busy0
        if self.charge:
            clock.now += max(spent - fwd, 0.0) if trace.overlap else spent
        trace.step_sched_s.append(spent)
        trace.step_sched_cpu_s.append(spent_cpu)
        trace.step_forward_s.append(fwd)
        if self.estimator is not None:
            trace.prefill_estimate.append(self.estimator.tokens_per_s)
        q = sched.queues
        trace.step_running.append(len(q.running.reqs))
        trace.step_waiting.append(len(q.waiting))
        trace.timeline.append((clock.now, sched.kv.usage(), len(q.running.reqs), len(q.waiting)))
        return outs


def _close_trace(trace: SimTrace, sched: SchedulerCore, runner: SimRunner, clock: VirtualClock,
                 max_timeline: int) -> None:
    trace.duration = clock.now
    trace.gpu_busy = runner.busy
    st = sched.stats
    trace.stats = {
        "forward_steps": st.forward_steps, "prefill_steps": st.prefill_steps, "decode_steps": st.decode_steps,
        "prompt_tokens": st.prompt_tokens, "cached_tokens": st.cached_tokens, "prefill_tokens": st.prefill_tokens,
        "generated_tokens": st.generated_tokens, "num_retractions": st.num_retractions,
        "num_preemptions": st.num_preemptions, "num_aborted": st.num_aborted, "num_finished": st.num_finished,
        "cache_hit_rate": st.cache_hit_rate,
    }
    tier = tier_figures([sched.kv])
    if tier is not None:
        trace.stats["host_tier"] = tier
    spec = sched.parts.spec
    if spec is not None:
        trace.stats.update(spec_verify_steps=spec.stats.verify_steps, **spec_counts(spec))
    if len(trace.timeline) > max_timeline:  # keep the plot and the JSON small
        stride = math.ceil(len(trace.timeline) / max_timeline)
        trace.timeline = trace.timeline[::stride]
