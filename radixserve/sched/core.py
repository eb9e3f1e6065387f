"""``SchedulerCore``: the scheduler's loop around the parts it is given (``parts.py``).

A step is ``get_next_batch_to_run`` (the ``BatchBuilder``'s: SGLang's prefill-then-decode in
``scheduler.py``, vLLM's token budget in ``unified_scheduler.py``), the runner's ``forward`` and
``process_batch_result`` (``Outputs``, the deadline estimator, the policy's ``on_batch``). The
normal loop runs them in order; the overlap loop (``step_overlapped``) builds and launches step
N+1 on the ``ForwardThread`` before it processes step N's results. Intake, admin (policy switch,
cache flush, load) and the idle self-check are here too; everything else is a manager's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, final

from radixserve.mem.forward_batch import ForwardBatch, ForwardOutput
from radixserve.sched.finish import FINISH_ABORT, FinishReason
from radixserve.sched.io import BatchOut
from radixserve.sched.overlap import InFlight
from radixserve.sched.parts import BatchBuilder, SchedParts
from radixserve.sched.req import Req
from radixserve.sched.request_checks import Limits
from radixserve.sched.schedule_batch import ForwardMode, ScheduleBatch

logger = logging.getLogger(__name__)
_GRAMMAR_WAIT = 0.005  # seconds the loop waits on a grammar's compile (or a KV load) with nothing else to do

Command = tuple[str, str]  # ("abort", rid)


@final
class SchedulerCore:
    def __init__(self, parts: SchedParts, builder: BatchBuilder, *, context_len: int, vocab_size: int | None = None,
                 eos_token_ids: Sequence[int] = ()) -> None:
        self.parts = parts
        self.builder = builder
        self.context_len = context_len
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.settings = parts.settings
        self.clock = parts.clock
        self.queues = parts.queues
        self.stats = parts.stats
        self.kv = parts.kv
        self.runner = parts.runner
        self.forward = parts.forward
        self.outputs = parts.outputs
        self.deadlines = parts.deadlines
        self.grammars = parts.grammars
        self.intake = parts.intake
        self.cur_batch: ScheduleBatch | None = None
        self.last_batch: ScheduleBatch | None = None
        self._idle_checked = True

    def limits(self) -> Limits:
        """What a request must fit to run here, for the edge that checks it (``request_checks``)."""
        return Limits(self.vocab_size, self.context_len, self.kv.total_tokens)

    # --- intake ----------------------------------------------------------------------------------
    def add_request(self, req: Req) -> None:
        """Queue a request, or finish it at once with an abort that says why it cannot run."""
        if self.intake.add(req):
            self._idle_checked = False

    def abort_request(self, rid: str, message: str = "aborted by the client", status_code: int = 499) -> bool:
        return self.intake.abort(rid, message, status_code)

    def finish(self, req: Req, reason: FinishReason) -> None:
        """End a request that holds no KV (refused before it was queued) through the output path."""
        self.outputs.finish(req, reason)

    def take_outputs(self) -> BatchOut:
        return self.outputs.take()

    # --- one step --------------------------------------------------------------------------------
    def has_work(self) -> bool:
        q, fwd = self.queues, self.forward
        return bool(q.waiting or q.running.reqs or q.chunked or fwd.in_flight or fwd.held or self.grammars.pending
                    or self.kv.loads_pending() or self.builder.busy(self.last_batch))

    def _parked(self) -> bool:
        """Whether requests wait outside the queue (a grammar compiling, a prefix loading); if so,
        wait a little on them: nothing else can run until they are ready."""
        if self.grammars.pending:
            self.grammars.wait(_GRAMMAR_WAIT)
        elif self.kv.loads_pending():
            self.kv.wait_loads(_GRAMMAR_WAIT)
        else:
            return False
        return True

    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        batch = self.builder.next_batch(self.last_batch)
        q = self.queues
        if batch is None and (q.waiting or self.kv.loads_pending()) and not q.running.reqs and not q.chunked:
            batch = self._unblock_tier_holds()
        return batch

    def _unblock_tier_holds(self) -> ScheduleBatch | None:
        """Nothing runs and nothing was admitted: prefixes the KV tier loaded for waiting requests may
        be what fills the pool. Those requests go first (each needs little more); if even they cannot
        run, the prefixes are unlocked (and may be evicted) and the queue tries again."""
        q = self.queues
        held = self.kv.tier_held()
        if held:
            rest = [r for r in q.waiting if r not in held]
            q.waiting = [r for r in q.waiting if r in held]
            try:
                batch = self.builder.next_batch(self.last_batch)
            finally:
                q.waiting += rest
            if batch is not None:
                return batch
        if not self.kv.drop_tier_holds():
            return None
        self.intake.poll()
        return self.builder.next_batch(self.last_batch)

    def step(self) -> BatchOut:
        self.intake.poll()
        batch = self.get_next_batch_to_run()
        self.cur_batch = batch
        if batch is not None:
            out = self.run_batch(batch)
            if out is not None:
                self.process_batch_result(batch, out)
        elif self._parked():  # nothing to run until a grammar compiles or a load lands: no spinning
            pass
        elif not self._idle_checked and not self.has_work():
            self.on_idle()
        self.last_batch = batch
        return self.outputs.take()

    # --- the overlap loop ---------------------------------------------------------------------------
    def overlap_enabled(self) -> bool:
        """``--overlap-schedule`` on or auto (the engine resolves auto before it builds the scheduler,
        the simulator keeps it), and nothing that needs the normal loop: tensor parallelism (its ranks replay the request table's writes, which must not
        change while a forward ships them) and disaggregation (its transfers follow each step's
        results)."""
        a = self.settings.args
        if a.overlap_schedule == "off":
            return False
        return a.tp_size == 1 and a.disaggregation_mode == "null"

    def can_build_ahead(self, running: InFlight) -> bool:
        """Whether the next step may be scheduled before ``running``'s results are processed.
        Only after a decode step (a prefill's results feed the prefix cache and the chunked
        request), never with priority preemption (a victim could be a request in flight), and as
        the builder allows (``PrefillFirst``: not when the next decode would have to retract).
        With speculative decoding only while the batch is too large to draft: drafts come from the
        tokens the step in flight accepts, and a step with drafts gives back KV when it ends."""
        spec = self.parts.spec
        return (running.batch.forward_mode is ForwardMode.DECODE and not self.settings.prio.enabled
                and (spec is None or (running.batch.drafts is None and not spec.active(len(running.batch.reqs))))
                and self.builder.may_build_ahead())

    def step_overlapped(self) -> BatchOut:
        """One iteration of SGLang's overlap loop: schedule step N+1 while step N's forward runs,
        launch it, then process step N's results (one step late). A request that step N finishes
        is in step N+1 too; the token it gets there is dropped, so outputs equal the normal loop's.
        Falls back to the normal order for a step that ``can_build_ahead`` refuses."""
        self.intake.poll()
        fwd = self.forward
        prev = fwd.in_flight
        if prev is not None and not self.can_build_ahead(prev):
            fwd.take()
            self._collect(prev)
            prev = None
        spec = self.parts.spec
        if spec is not None:
            spec.ahead = prev is not None  # a step built ahead drafts nothing (its tokens are not known yet)
        try:
            batch = self.get_next_batch_to_run()
        finally:
            if spec is not None:
                spec.ahead = False
        self.cur_batch = batch
        if batch is not None:
            try:
                fwd.launch(batch, prev)  # the new step is in flight now
            except Exception as e:
                self._abort_batch(batch, e)
        else:
            fwd.take()
        if prev is not None:
            self._collect(prev)
        fwd.release_held()  # those only the collected step included
        if fwd.in_flight is None and batch is None and self._parked():
            pass
        elif fwd.in_flight is None and batch is None and not self._idle_checked and not self.has_work():
            self.on_idle()
        self.last_batch = batch
        return self.outputs.take()

    def drain_in_flight(self) -> BatchOut:
        """Wait for the running forward and process its results (stopping, or switching loops)."""
        running = self.forward.take()
        if running is not None:
            self._collect(running)
            self.forward.release_held()
        return self.outputs.take()

    def _collect(self, running: InFlight) -> None:
        try:
            out, dt = self.forward.result(running)
        except Exception as e:
            self._abort_batch(running.batch, e)
            return
        self._count_step(running.batch, running.fb, dt)
        self.process_batch_result(running.batch, out)

    def event_loop(
        self,
        recv: Callable[[bool], list[Req | Command]],
        send: Callable[[BatchOut], None],
        should_stop: Callable[[], bool] = lambda: False,
    ) -> None:
        """The loop the options ask for: overlap unless ``overlap_enabled`` says otherwise."""
        if self.overlap_enabled():
            self.event_loop_overlap(recv, send, should_stop)
        else:
            self.event_loop_normal(recv, send, should_stop)

    def event_loop_normal(
        self,
        recv: Callable[[bool], list[Req | Command]],
        send: Callable[[BatchOut], None],
        should_stop: Callable[[], bool] = lambda: False,
    ) -> None:
        """recv(block) returns new requests (or ("abort", rid) commands); block when idle."""
        self._loop(self.step, recv, send, should_stop)

    def event_loop_overlap(
        self,
        recv: Callable[[bool], list[Req | Command]],
        send: Callable[[BatchOut], None],
        should_stop: Callable[[], bool] = lambda: False,
    ) -> None:
        """``event_loop_normal`` with ``step_overlapped``: while a forward runs, the scheduler
        receives requests, schedules the next step and processes the previous step's results."""
        try:
            self._loop(self.step_overlapped, recv, send, should_stop)
        finally:
            outs = self.drain_in_flight()
            if outs:
                send(outs)

    def _loop(
        self, step: Callable[[], BatchOut], recv: Callable[[bool], list[Req | Command]],
        send: Callable[[BatchOut], None], should_stop: Callable[[], bool],
    ) -> None:
        while not should_stop():
            for item in recv(not self.has_work()):
                if isinstance(item, Req):
                    self.add_request(item)
                else:
                    self.abort_request(item[1])
            outs = step()
            if outs:
                send(outs)

    def on_idle(self) -> None:
        self._idle_checked = True
        self.builder.on_idle()
        if self.settings.args.idle_self_check and not self.kv.held_outside():
            self.kv.check_invariant()

    def run_batch(self, batch: ScheduleBatch) -> ForwardOutput | None:
        # The step's duration on the scheduler's clock: wall time on the engine, virtual time under
        # the simulator (whose runner advances the clock), so estimators built on it work in both.
        t0 = self.clock()
        try:
            fb = batch.to_forward_batch()
            out = self.runner.forward(fb)
        except Exception as e:  # one bad step must not take the engine down
            self._abort_batch(batch, e)
            return None
        self._count_step(batch, fb, self.clock() - t0)
        return out

    def _count_step(self, batch: ScheduleBatch, fb: ForwardBatch, seconds: float) -> None:
        s = self.stats
        s.forward_steps += 1
        mode, bs, tokens = batch.forward_mode, len(batch.reqs), fb.num_tokens
        s.step_log.append((mode.name, bs, tokens, seconds))
        decode = tokens if mode is ForwardMode.DECODE else batch.num_decode
        s.recent_steps.append((mode.name, bs, tokens - decode, decode, seconds))
        if batch.forward_mode.is_extend():
            s.prefill_steps += 1
        else:
            s.decode_steps += 1
            if self.parts.spec is not None:
                self.parts.spec.observe(tokens, seconds)

    def _abort_batch(self, batch: ScheduleBatch, e: Exception) -> None:
        """A forward failed: abort its requests (the ones not already ended), caching none of its KV."""
        logger.error("forward failed; aborting the %d requests of this batch", len(batch.reqs), exc_info=e)
        for req in list(batch.reqs):
            if req.finished_reason is not None:
                continue
            if req is self.queues.chunked:
                self.queues.chunked = None
            self.kv.discard(req)  # this step's KV was never written: cache none of it
            self.outputs.finish(req, FINISH_ABORT(f"internal error: {e}", status_code=500,
                                                  err_type="server_error", code="internal_error"))
        batch.reqs = []

    def process_batch_result(self, batch: ScheduleBatch, out: ForwardOutput) -> None:
        spec = self.parts.spec
        kept = spec.accept(batch, out, self.kv.keep_path) if spec is not None and batch.drafts is not None else None
        self.outputs.process_batch_result(batch, out, kept)
        self.deadlines.observe(batch)
        self.settings.policy.on_batch(batch)

    # --- admin -----------------------------------------------------------------------------------
    def set_schedule_policy(self, params: dict[str, Any]) -> dict[str, Any]:
        """Switch the policy and/or its parameters between steps, keeping every request."""
        return self.settings.switch(params)

    def flush_cache(self) -> bool:
        """Drop every cached prefix; only when idle (as SGLang)."""
        if self.has_work():
            return False
        self.kv.flush()
        return True

    def get_load(self) -> dict[str, float]:
        """SGLang's /get_load entry. ``num_reqs`` counts every unfinished request, also one whose
        prefill just ran and that is not merged into the running batch yet; ``num_tokens`` is, as
        SGLang counts it, the KV tokens in use (``num_used_tokens``) plus the tokens of the waiting
        requests (``num_waiting_tokens``: their prompts, cache hits not yet known). For a router
        that predicts time to first token: those waiting tokens and the measured prefill speed."""
        q = self.queues
        used = self.kv.total_tokens - self.kv.reclaimable_size()
        waiting = sum(r.num_tokens - r.num_computed_tokens for r in q.waiting)
        return {
            "num_reqs": len(q.by_rid),
            "num_waiting_reqs": len(q.waiting),
            "num_grammar_queue_reqs": len(self.grammars),  # waiting for their grammar to compile
            "num_kv_loading_reqs": self.kv.loads_pending(),  # waiting for their prefix to load from the KV tier
            "num_tokens": used + waiting,
            "num_used_tokens": used,
            "num_waiting_tokens": waiting,
            "prefill_tokens_per_s": round(self.deadlines.throughput.tokens_per_s, 1),
            # steps run since start: how far the engine got between two reads (an abort's latency)
            "forward_steps": self.stats.forward_steps,
        }


def calm_garbage_collector() -> None:
    """Call once the long-lived objects exist (weights, pools, a workload): move them out of the
    collector's reach and make full collections rare. A scheduler allocates many short-lived objects
    per step, and with the defaults a full collection over millions of live objects stalled single
    steps by 100-300 ms (measured under the simulator at 1,024 running + 8,192 waiting)."""
    import gc

    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 50, 100)
