"""``PrefillFirst``: SGLang's way of turning the waiting queue into model steps (a ``BatchBuilder``).

Each step, ``next_batch``:
1. merges the last prefill batch into ``running_batch`` (all but the still-chunked request);
2. tries to build a new prefill batch (``get_new_batch_prefill``): the policy orders
   ``waiting_queue``, the ``PrefillAdder`` admits requests within its budgets; prefill goes first;
3. otherwise decodes ``running_batch`` one token (``update_running_batch``), retracting requests
   back to the waiting queue when the next step cannot get KV slots.

The managers (``parts.py``) do the rest: ``Ordering`` orders the queue, ``Preemption`` makes room
for more important requests and retracts, ``Outputs`` turns results into tokens and records.
``new_token_ratio`` (SGLang's estimate of how much of ``max_new_tokens`` running requests will
still use) is this builder's own state.
"""

from __future__ import annotations

from radixserve.config import ServerArgs
from radixserve.sched.parts import SchedParts
from radixserve.sched.prefill_adder import AddReqResult, PrefillAdder
from radixserve.sched.req import Req
from radixserve.sched.schedule_batch import ForwardMode, ScheduleBatch
from radixserve.sched.spec import attach_drafts


class PrefillFirst:
    def __init__(self, parts: SchedParts) -> None:
        self.parts = parts
        self.settings = parts.settings
        self.queues = parts.queues
        self.kv = parts.kv
        self.stats = parts.stats
        self.intake = parts.intake
        self.deadlines = parts.deadlines
        self.preemption = parts.preemption
        a = parts.settings.args
        self.init_new_token_ratio = min(a.init_new_token_ratio * a.schedule_conservativeness, 1.0)
        self.min_new_token_ratio = min(self.init_new_token_ratio * a.min_new_token_ratio_factor, 1.0)
        self.new_token_ratio_decay = (self.init_new_token_ratio - self.min_new_token_ratio) / a.new_token_ratio_decay_steps
        self.new_token_ratio = self.init_new_token_ratio
        self._ended_at_filter = 0  # finished + aborted when the running batch was last filtered

    @property
    def args(self) -> ServerArgs:
        return self.settings.args

    def busy(self, last: ScheduleBatch | None) -> bool:
        """The last prefill's requests, until the next step merges them into the running batch."""
        return last is not None and last.forward_mode.is_extend() and any(not r.finished() for r in last.reqs)

    def may_build_ahead(self) -> bool:
        """Not while a prompt is being chunked (its next chunk starts from the cache entry its last
        chunk's results make), nor when the next decode step would have to retract (a victim could
        be a request in flight)."""
        kv, q = self.kv, self.queues
        return q.chunked is None and kv.decode_tokens_needed(q.running.reqs) <= kv.reclaimable_size()

    def on_idle(self) -> None:
        self.new_token_ratio = self.init_new_token_ratio

    def next_batch(self, last: ScheduleBatch | None) -> ScheduleBatch | None:
        q = self.queues
        if last is not None and last.forward_mode.is_extend():
            q.running.extend([r for r in last.reqs if not r.finished() and r is not q.chunked])
        self.intake.apply_aborts()  # after the merge, so a request prefilled last step is aborted now too
        self.intake.abort_timed_out()
        ended = self.stats.num_finished + self.stats.num_aborted  # only Outputs.finish sets finished_reason
        if ended != self._ended_at_filter:  # a request ended since the last pass: drop the ended ones
            self._ended_at_filter = ended
            q.running.drop_finished()
        if self.decode_turn(last):
            return self.update_running_batch()
        batch = self.get_new_batch_prefill()
        if batch is not None:
            return batch
        return self.update_running_batch()

    def decode_turn(self, last: ScheduleBatch | None) -> bool:
        """``--enable-dynamic-chunking`` without mixed chunks: after a prefill step the running
        requests decode once before the next prefill (otherwise a chunked prompt's chunks run back
        to back and the decodes wait for all of them, however small the chunks)."""
        a = self.args
        return (a.enable_dynamic_chunking and not a.enable_mixed_chunk and last is not None
                and last.forward_mode is ForwardMode.EXTEND and bool(self.queues.running.reqs))

    # --- prefill -------------------------------------------------------------------------------
    def get_new_batch_prefill(self) -> ScheduleBatch | None:
        q, kv, a = self.queues, self.kv, self.args
        prio_on = self.settings.prio.enabled
        if not q.waiting and q.chunked is None:
            return None
        held = self.parts.held_slots()  # ended, but their slots are free only once the forward in flight is done
        running_bs = len(q.running.reqs) + held
        if running_bs >= q.max_running_requests and q.chunked is None and not prio_on:
            return None
        deadlines = self.deadlines
        tpot = deadlines.tpot_in_use  # TPOT deadlines pace prefills and cap the batch (deadline.py)
        tight = deadlines.tightest(q.running.reqs) if tpot else None
        if tpot and not deadlines.may_prefill(tight) and q.running.reqs:
            return None

        running = q.running.reqs
        mixed = a.enable_mixed_chunk and bool(running)
        adder = PrefillAdder(
            kv, kv.available_size(), running, self.new_token_ratio,
            a.max_prefill_tokens, self.chunk_budget(), kv.page_size, a.clip_max_new_tokens,
            mixed_with_decode_tokens=len(running) if mixed else 0,
        )
        chunked = q.chunked
        if chunked is not None:
            kv.match(chunked)
            q.chunked = adder.add_chunked_req(chunked)

        if q.waiting:
            q.waiting = self.parts.ordering.order(q.waiting, self.parts.clock())
        max_new_reqs = a.prefill_max_requests
        victims: list[Req] = []  # running requests preempted by more important ones
        for req in q.waiting:
            if max_new_reqs is not None and len(adder.can_run_list) >= max_new_reqs:
                break
            if tpot:
                tight_with = deadlines.tightest([req], tight)
                cap = deadlines.batch_cap(tight_with)
                if cap is not None and running_bs + len(adder.can_run_list) + 1 > max(cap, 1):
                    break
                tight = tight_with  # (kept if it is admitted; a request not admitted ends the round)
            state = adder.budget_state()
            if state is AddReqResult.OTHER or (state is AddReqResult.NO_TOKEN and not prio_on):
                break
            if running_bs + len(adder.can_run_list) >= q.max_running_requests:
                if not prio_on:
                    break
                kv.match(req)
                if not self.preemption.preempt_for(req, adder, victims, need_slot=True):
                    break
                running_bs = len(q.running.reqs) + held
            kv.match(req)
            if self.preemption.add_or_preempt(req, adder, victims) is not AddReqResult.CONTINUE:
                break
        q.waiting.extend(victims)
        if adder.new_chunked_req is not None:
            q.chunked = adder.new_chunked_req
        can_run = adder.can_run_list
        if not can_run:
            return None

        q.remove_waiting(can_run[1:] if can_run[0] is chunked else can_run)  # the ones from the queue
        batch = ScheduleBatch(can_run, ForwardMode.EXTEND)
        self.settings.policy.on_admitted(can_run)
        for req in can_run:
            if req.req_pool_idx is None:
                self.parts.admit(req)
            batch.prefix_lens.append(req.num_computed_tokens)
            batch.extend_lens.append(req.extend_input_len)
            batch.out_slots.extend(kv.grow(req, req.extend_input_len))
        self.stats.prefill_tokens += sum(batch.extend_lens)
        if mixed and q.running.reqs and kv.decode_tokens_needed(q.running.reqs) <= kv.reclaimable_size():
            self.mix_with_running(batch)
        return batch

    def mix_with_running(self, batch: ScheduleBatch) -> None:
        """``--enable-mixed-chunk``: the running requests decode in this prefill's forward (MIXED).
        They leave the running batch for the step and come back with the prefilled requests when
        the next step merges the last batch."""
        running = self.queues.running
        positions, slots = self.kv.grow_decode(running.reqs)
        batch.reqs.extend(running.reqs)
        batch.prefix_lens.extend(positions)
        batch.extend_lens.extend([1] * len(positions))
        batch.out_slots.extend(slots)
        batch.num_decode = len(positions)
        batch.forward_mode = ForwardMode.MIXED
        running.reqs = []
        self.new_token_ratio = max(self.new_token_ratio - self.new_token_ratio_decay, self.min_new_token_ratio)

    def chunk_budget(self) -> int | None:
        """``--chunked-prefill-size``, or with ``--enable-dynamic-chunking`` while requests decode,
        the tokens the measured prefill speed fits into ``--dynamic-chunk-target-ms`` (less one
        decode step when the decodes share the forward), in whole pages, at least one page or 32
        tokens."""
        a = self.args
        size = a.chunk_size
        if not a.enable_dynamic_chunking or not self.queues.running.reqs:
            return size
        est = self.deadlines.throughput
        budget_s = a.dynamic_chunk_target_ms / 1e3 - (est.decode_step_s if a.enable_mixed_chunk else 0.0)
        ps = self.kv.page_size
        floor = max(ps, -(-32 // ps) * ps)
        n = max(int(budget_s * est.tokens_per_s) // ps * ps, floor)
        return n if size is None else min(n, size)

    # --- decode & retraction -------------------------------------------------------------------
    def update_running_batch(self) -> ScheduleBatch | None:
        batch, kv = self.queues.running, self.kv
        if batch.is_empty():
            return None
        if kv.decode_tokens_needed(batch.reqs) > kv.reclaimable_size():
            self.retract_decode(batch)
        else:
            self.new_token_ratio = max(self.new_token_ratio - self.new_token_ratio_decay, self.min_new_token_ratio)
        if batch.is_empty():
            return None
        batch.forward_mode = ForwardMode.DECODE
        batch.prefix_lens, batch.out_slots = kv.grow_decode(batch.reqs)  # = grow(r, 1) for each
        batch.extend_lens = [1] * len(batch.reqs)
        batch.drafts = None
        spec = self.parts.spec
        if spec is not None and spec.active(len(batch.reqs)):
            # drafts take what is left once the next plain step is still covered: they never retract
            room = kv.reclaimable_size() - kv.decode_tokens_needed(batch.reqs)
            drafts = spec.draft(batch.reqs, room, kv.slots_for)
            if drafts is not None:
                attach_drafts(batch, drafts, kv.grow)
        return batch

    def retract_decode(self, batch: ScheduleBatch) -> list[Req]:
        """Send requests back to the waiting queue until the rest can decode for
        ``--retract-decode-steps`` more steps; raise ``new_token_ratio`` to the survivors' estimate."""
        retracted, estimate = self.preemption.retract_decode(batch)
        self.new_token_ratio = max(self.new_token_ratio, estimate)
        return retracted
