"""The scheduler process: owns the model and the KV memory, runs the scheduler's event loop
(the overlap loop by default).

Each loop iteration (SGLang's ``recv_requests``): drain every message that arrived without
blocking, or, with nothing to do, wait up to ``IDLE_POLL_S`` for one; then run one step and send
its ``BatchOut`` on to the detokenizer. Control messages
(flush_cache, get_load, memory, dashboard) are answered between steps, when the scheduler state is whole.

Every ``--decode-log-interval`` decode steps it logs a line like SGLang's::

    Decode batch. #running-req: 3, #token: 310, token usage: 0.04, gen throughput (token/s): 41.20, #queue-req: 0

With ``--cache-events-port`` the radix cache reports its changes to a ``CacheEventPublisher``,
which sends what a step produced as one batch at the end of the step (server/cache_events.py).
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from typing import Any

import zmq

from radixserve.config import ServerArgs
from radixserve.sched.core import SchedulerCore, calm_garbage_collector
from radixserve.sched.io import BatchOut
from radixserve.sched.req import Req
from radixserve.sched.spec import spec_counts
from radixserve.server.io_struct import (
    ENCODER,
    AbortReq,
    ControlReply,
    ControlReq,
    GenerateReq,
    LoadProgress,
    ProcReady,
    RankLoad,
    SchedulerStats,
    ToScheduler,
    decoder,
)
from radixserve.server.kv_events import EventPublishers, open_cache_events
from radixserve.server.procs import IpcNames, child_init, parent_alive, pull_socket, push_socket
from radixserve.server.scheduler.dashboard_state import rank_snapshot
from radixserve.server.scheduler.pd_worker import PDWorker
from radixserve.serving_build import build_scheduler, grammar_compiler

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.05  # how long an idle scheduler waits for a message before looking around
LOAD_REPORT_S = 0.005  # --dp-size: at most one load report to the controller this often while requests wait
STATS_INTERVAL_S = 0.5  # how often a busy scheduler reports its gauges to /metrics
def make_runner(args: ServerArgs) -> Any:
    if args.tp_size > 1:  # rank 0 of the tensor-parallel group; the other ranks are tp_worker_proc children
        from radixserve.model.tp_worker import load_tp_rank

        return load_tp_rank(args, 0)
    from radixserve.model.model_runner import runner_from_args

    # NOTE: progress=False: the HTTP process draws the one loading bar (two processes drawing
    # bars on one terminal garble each other).
    return runner_from_args(args, progress=False)


def run_scheduler_process(args: ServerArgs, ipc: IpcNames, parent_pid: int, dp_rank: int | None = None) -> None:
    """``dp_rank`` None: the only scheduler; else rank ``dp_rank`` of ``--dp-size`` behind the controller."""
    name = "scheduler" if dp_rank is None else f"scheduler_{dp_rank}"
    child_init(args.log_level, "Scheduler" if dp_rank is None else f"DP{dp_rank}")
    ctx = zmq.Context()
    recv_sock = pull_socket(ctx, ipc.scheduler if dp_rank is None else ipc.scheduler_rank(dp_rank))
    to_detok = push_socket(ctx, ipc.detokenizer)
    to_tm = push_socket(ctx, ipc.tokenizer)
    to_controller = push_socket(ctx, ipc.dp_load) if dp_rank is not None else None
    try:
        to_tm.send(ENCODER.encode(LoadProgress("loading model weights")))
        runner = make_runner(args)
        to_tm.send(ENCODER.encode(LoadProgress("model loaded")))
        context_len = runner.max_context_len
        publisher = open_cache_events(ctx, args, dp_rank or 0, args.page_size)
        grammars = grammar_compiler(runner)
        scheduler = build_scheduler(args, runner, context_len, publisher.add if publisher is not None else None,
                                    dp_rank, grammars)
        to_tm.send(ENCODER.encode(LoadProgress("KV cache allocated")))
    except Exception as e:
        logger.error("scheduler failed to start:\n%s", traceback.format_exc())
        to_tm.send(ENCODER.encode(ProcReady(name, error=f"{type(e).__name__}: {e}")))
        time.sleep(0.2)  # let the message leave before the context goes
        sys.exit(1)
    info = {
        "context_len": context_len,
        "vocab_size": runner.model_config.vocab_size,
        "max_total_num_tokens": scheduler.kv.total_tokens,
        "max_running_requests": scheduler.queues.max_running_requests,
        "max_req_input_len": context_len - 1,
        "page_size": scheduler.kv.page_size,
        "dtype": str(getattr(runner, "dtype", args.dtype)).removeprefix("torch."),
        **{k: runner.model_config.to_hf_dict()[k] for k in ("model_type", "architectures")},
        "pid": os.getpid(),
    }
    to_tm.send(ENCODER.encode(ProcReady(name, info=info)))
    # Off the path to a healthy server: the scheduler starts with the stop ids alone (read from the
    # model file) and builds the tokenizer here, on its main thread, before the grammar compiler's
    # warm-up (on the compiler's thread) asks for it.
    runner.load_tokenizer()
    grammars.warm_up()
    server = SchedulerServer(args, scheduler, recv_sock, to_detok, to_tm, parent_pid, dp_rank or 0, to_controller,
                             publisher)
    calm_garbage_collector()
    try:
        scheduler.event_loop(server.recv, server.send, server.should_stop)
    finally:
        scheduler.kv.close()  # the KV tier's queued writes land before the process goes
        if publisher is not None:
            publisher.close()
        ctx.destroy(linger=0)
    if tp_broken(runner):
        logger.error("a tensor-parallel rank is gone (%s); the scheduler exits", runner.tp.broken)
        sys.exit(1)
    if hasattr(runner, "shutdown"):
        runner.shutdown()  # tensor parallelism: tells the other ranks to exit
    logger.info("scheduler stopped: the HTTP process is gone")


def tp_broken(runner: Any) -> bool:
    """Whether a collective of rank 0 failed: another rank died, and the group cannot go on."""
    tp = getattr(runner, "tp", None)
    return tp is not None and tp.broken is not None


class SchedulerServer:
    """The ZMQ side of the scheduler: the recv/send/should_stop callables of its event loop."""

    def __init__(
        self,
        args: ServerArgs,
        scheduler: SchedulerCore,
        recv_sock: zmq.Socket,
        to_detok: zmq.Socket,
        to_tm: zmq.Socket,
        parent_pid: int,
        dp_rank: int = 0,
        to_controller: zmq.Socket | None = None,
        publisher: EventPublishers | None = None,
    ) -> None:
        self.args = args
        self.sched = scheduler
        self.recv_sock = recv_sock
        self.to_detok = to_detok
        self.to_tm = to_tm
        self.parent_pid = parent_pid
        self.dp_rank = dp_rank
        self.to_controller = to_controller
        self.publisher = publisher
        self._last_load: tuple[int, int] = (0, 0)
        self._last_load_time = 0.0
        self.decoder = decoder(ToScheduler)
        self.eos_token_ids = scheduler.eos_token_ids
        # what the detokenizer needs about a request, sent along with its first output
        self._last_decode_logged = 0
        self._last_prefill_logged: object = None
        self._last_stats_time = 0.0
        self._last_stats_key: tuple[int, ...] = ()
        self._tp_time = time.monotonic()
        self._tp_tokens = 0
        self._gen_throughput = 0.0
        self._stop = False
        # --disaggregation-mode prefill|decode: the bootstrap / KV transfer side (server/scheduler/pd_worker.py)
        self.pd = PDWorker.create(args, scheduler, recv_sock.context, dp_rank)

    # --- event-loop callables ------------------------------------------------------------------
    def should_stop(self) -> bool:
        return self._stop or not parent_alive(self.parent_pid) or tp_broken(self.sched.runner)

    def recv(self, block: bool) -> list[Req | tuple[str, str]]:
        self._after_step()
        items: list[Req | tuple[str, str]] = []
        if self.pd is not None:
            items.extend(self.pd.tick(self.send))  # decode requests whose KV arrived
            block = block and not items
            if block and not self.pd.wait(self.recv_sock, int(IDLE_POLL_S * 1000)):
                return items
        elif block and not self.recv_sock.poll(int(IDLE_POLL_S * 1000)):
            return items
        while True:
            try:
                raw = self.recv_sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            msg = self.decoder.decode(raw)
            if isinstance(msg, GenerateReq):
                req = self._make_req(msg)
                if req is not None:
                    items.append(req)
            elif isinstance(msg, AbortReq):
                if self.pd is None or not self.pd.abort(msg.rid, self.send):
                    items.append(("abort", msg.rid))
            elif isinstance(msg, ControlReq):
                # NOTE: earlier items of this drain are not yet added; apply them first so a
                # flush or a memory check sees every request that arrived before it.
                self._add_items(items)
                items = []
                self.to_tm.send(ENCODER.encode(ControlReply(msg.req_id, self._control(msg.op, msg.params),
                                                            self.dp_rank)))
                if self.publisher is not None:  # a flush's AllCleared goes out now, not after the next step
                    self.publisher.flush()
        return items

    def send(self, outs: BatchOut) -> None:
        if self.pd is not None:
            self.pd.on_outputs(outs)
        outs.dp_rank = self.dp_rank
        self.to_detok.send(ENCODER.encode(outs))

    # --- requests --------------------------------------------------------------------------------
    def _make_req(self, msg: GenerateReq) -> Req | None:
        params = msg.sampling_params  # validated by the HTTP process
        now = self.sched.clock()
        req = Req(msg.rid, msg.input_ids, params, arrival_time=now, priority=msg.priority,
                  eos_token_ids=self.eos_token_ids, stream=msg.stream)
        req.tenant = msg.tenant
        if msg.input_logprob_start is not None:  # (checked against the prompt by the HTTP process)
            req.want_input_logprobs(msg.input_logprob_start)
        if msg.deadline_ms is not None:
            req.deadline = now + msg.deadline_ms / 1000.0
        if msg.tpot_slo_ms is not None:
            req.tpot_slo = msg.tpot_slo_ms / 1000.0
        if self.pd is not None and msg.bootstrap is not None:
            return self.pd.on_request(msg, req, self.send)
        return req

    def _add_items(self, items: list[Req | tuple[str, str]]) -> None:
        for item in items:
            if isinstance(item, Req):
                self.sched.add_request(item)
            else:
                self.sched.abort_request(item[1])
        if items:
            outs = self.sched.take_outputs()  # refusals and aborts of waiting requests, emitted at once
            if outs:
                self.send(outs)

    # --- control ---------------------------------------------------------------------------------
    def _control(self, op: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        if op == "set_schedule_policy":  # between steps: the queue and running batch stay
            return self.sched.set_schedule_policy(dict(params or {}))
        if op in ("flush_cache", "memory"):
            # a step scheduled ahead (overlap) may still hold requests that already ended: let it
            # finish, so a flush or a memory check right after the last response sees the engine idle
            outs = self.sched.drain_in_flight()
            if outs:
                self.send(outs)
        if op == "flush_cache":
            return {"success": self.sched.flush_cache()}
        if op == "get_load":
            return self.load()
        if op == "dashboard":
            return rank_snapshot(self.sched, self.dp_rank)
        if op == "kv_tier":
            tier = self.sched.kv.tier
            return {"dp_rank": self.dp_rank, "enabled": tier is not None, **(tier.snapshot() if tier else {})}
        if op == "memory":
            return self.memory()
        return {"error": f"unknown control op {op!r}"}

    def load(self) -> dict[str, Any]:
        """SGLang's /get_load entry for this data-parallel rank."""
        return {"dp_rank": self.dp_rank, **self.sched.get_load()}

    def memory(self) -> dict[str, Any]:
        kv = self.sched.kv
        idle = not self.sched.has_work() and (self.pd is None or self.pd.idle())
        out: dict[str, Any] = {
            "total": kv.total_tokens,
            "available": kv.available_size(),
            "evictable": kv.evictable_size(),
            "protected": kv.protected_size(),
            "req_slots_free": kv.req_to_token_pool.available_size(),
            "req_slots_total": kv.req_to_token_pool.size,
            "idle": idle,
            "invariant_ok": None,
            "invariant_error": None,
        }
        pool = getattr(self.sched.runner, "kv_pool", None)
        if pool is not None:  # how the pool stores KV (--kv-cache-dtype) and what a token takes
            out["kv_format"] = pool.format.name
            out["kv_bytes_per_token"] = pool.bytes_per_token_here()
        if self.pd is not None:
            out["disagg"] = self.pd.stats()
        if kv.tier is not None:
            out["tier"] = kv.tier.snapshot()
        if idle:
            try:
                kv.check_invariant()
                out["invariant_ok"] = True
            except AssertionError as e:
                out["invariant_ok"] = False
                out["invariant_error"] = str(e)
        return out

    # --- logs and stats --------------------------------------------------------------------------
    def _report_load(self) -> None:
        """Tell the data-parallel controller this rank's load when it changed. At most every
        ``LOAD_REPORT_S`` while busy: the waiting prompt tokens are a pass over the queue, not a
        thing to do every step; the controller counts what it sent in between."""
        assert self.to_controller is not None
        sched = self.sched
        now = time.monotonic()
        if sched.queues.waiting and now - self._last_load_time < LOAD_REPORT_S:
            return
        self._last_load_time = now
        waiting_tokens = sum(len(r.origin_input_ids) for r in sched.queues.waiting) if sched.queues.waiting else 0
        load = (len(sched.queues.by_rid), sched.kv.total_tokens - sched.kv.reclaimable_size() + waiting_tokens)
        if load != self._last_load:
            self._last_load = load
            self.to_controller.send(ENCODER.encode(RankLoad(self.dp_rank, *load)))

    def _after_step(self) -> None:
        if self.publisher is not None:
            self.publisher.flush()
        if self.to_controller is not None:
            self._report_load()
        sched = self.sched
        st = sched.stats
        last = sched.last_batch
        if last is not None and last.forward_mode.is_extend() and last is not self._last_prefill_logged:
            self._last_prefill_logged = last
            logger.info(
                "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
                "#running-req: %d, #queue-req: %d",
                len(last.reqs), sum(last.extend_lens), sum(last.prefix_lens), sched.kv.usage(),
                len(sched.queues.running.reqs), len(sched.queues.waiting),
            )
        interval = self.args.decode_log_interval
        if st.decode_steps - self._last_decode_logged >= interval:
            self._last_decode_logged = st.decode_steps - st.decode_steps % interval
            self._update_throughput()
            # requests that finished this step are still listed until the next batch is built, but
            # their KV is already released: count only the unfinished, as the token count does
            running = sum(1 for r in sched.queues.running.reqs if not r.finished())
            logger.info(
                "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, gen throughput (token/s): %.2f, "
                "#queue-req: %d",
                running, sched.kv.total_tokens - sched.kv.reclaimable_size(),
                sched.kv.usage(), self._gen_throughput, len(sched.queues.waiting),
            )
        now = time.monotonic()
        busy = sched.has_work()
        key = (st.forward_steps, st.num_finished, st.num_aborted, len(sched.queues.waiting), busy)
        if key != self._last_stats_key and (now - self._last_stats_time >= STATS_INTERVAL_S or not busy):
            self._last_stats_key = key
            self._last_stats_time = now
            self._update_throughput()
            self.to_tm.send(ENCODER.encode(self.stats()))

    def _update_throughput(self) -> None:
        now = time.monotonic()
        gen = self.sched.stats.generated_tokens
        if now - self._tp_time >= 0.2:
            self._gen_throughput = (gen - self._tp_tokens) / (now - self._tp_time)
            self._tp_time, self._tp_tokens = now, gen

    def stats(self) -> SchedulerStats:
        s = self.sched
        st = s.stats
        running = len(s.queues.by_rid) - len(s.queues.waiting)
        if not s.has_work():
            self._gen_throughput = 0.0
        return SchedulerStats(
            num_running_reqs=running,
            num_queue_reqs=len(s.queues.waiting),
            num_used_tokens=s.kv.total_tokens - s.kv.reclaimable_size(),
            token_usage=s.kv.usage(),
            cache_hit_rate=st.cache_hit_rate,
            gen_throughput=self._gen_throughput,
            prompt_tokens=st.prompt_tokens,
            cached_tokens=st.cached_tokens,
            generated_tokens=st.generated_tokens,
            num_retractions=st.num_retractions,
            forward_steps=st.forward_steps,
            num_preemptions=st.num_preemptions,
            num_starved=st.num_starved,
            num_deadline_rejected=st.num_deadline_rejected,
            **spec_counts(s.parts.spec),
            **(s.kv.tier.counts() if s.kv.tier is not None else {}),
            by_class=st.by_class.rows(),
            dp_rank=self.dp_rank,
        )
