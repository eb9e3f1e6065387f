"""``UnifiedScheduler`` (``--scheduler unified``): vLLM V1's ``schedule()`` over radixserve's KV.

There is no prefill phase and no decode phase. Every request is two counters,
``num_computed_tokens`` and ``num_tokens``; each step hands requests ``num_new_tokens`` so the
first catches up with the second, under one token budget:

1. Running requests first, in order: ``num_new = num_tokens - num_computed_tokens``, capped by
   ``--long-prefill-token-threshold`` (when > 0) and by what is left of
   ``--max-num-batched-tokens``. A decoding request asks for 1, a request mid-prompt for a chunk.
   When the KV pool cannot hold the step's tokens, preempt (by recompute): the last running
   request under ``--scheduling-policy fcfs``, the least important latest arrival under
   ``priority`` (a smaller priority value is more important, as in vLLM). The victim's KV goes to
   the radix cache, it goes to the front of the waiting queue, and if it was this request
   itself, the running pass stops.
2. Waiting requests next, only in a step that preempted nothing, while fewer than
   ``--max-num-seqs`` run: match the prefix cache, lock the match, take the rest of the prompt
   (capped as above); stop at the first request the KV pool cannot hold.

Everything goes into one forward: a ``ScheduleBatch`` with one extend length per request
(``ForwardMode.MIXED``, or ``DECODE`` when every request decodes one token). A request whose
``num_computed_tokens`` is still short of ``num_tokens`` after the step was a chunk and samples
nothing (``Scheduler.process_batch_result``).

KV is planned before anything is allocated (so a victim never holds KV of this step); the slots
are then taken with ``KVManager.grow``, which evicts unlocked cache leaves as needed. Intake,
aborts, ``--queue-timeout``, the queue cap, result processing and stats are the shared managers'
(``core.py``); this scheduler has no ``new_token_ratio`` and no chunked request of its own.
"""

from __future__ import annotations

from typing import Any

from radixserve.sched.core import InFlight, SchedulerCore
from radixserve.sched.req import Req
from radixserve.sched.schedule_batch import ForwardMode, ScheduleBatch


class UnifiedScheduler(SchedulerCore):
    def __init__(self, *args: Any, **kwargs: Any) -> None:  # SchedulerCore's parameters
        super().__init__(*args, **kwargs)
        a = self.args
        self.max_num_seqs = min(a.max_num_seqs, self.max_running_requests)
        self.long_prefill_token_threshold = a.long_prefill_token_threshold
        self.preempt_by_priority = a.scheduling_policy == "priority"

    # --- helpers -------------------------------------------------------------------------------
    def _cap(self, n: int, budget: int) -> int:
        t = self.long_prefill_token_threshold
        if 0 < t < n:
            n = t
        return min(n, budget)

    def _select_preempt_target(self, running: list[Req]) -> Req:
        if self.preempt_by_priority:  # vLLM: max(running, key=(priority, arrival_time))
            rank = self.settings.prio.rank
            return max(running, key=lambda r: (rank(r), r.arrival_time))
        return running[-1]

    def _preempt(self, victim: Req) -> None:
        self.kv.release(victim)  # computed KV -> radix cache: the recompute is mostly a cache hit
        victim.reset_for_retract()
        victim.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.stats.by_class.add(victim, "preemptions")
        self.waiting_queue.insert(0, victim)

    def _order_waiting(self) -> None:
        prio = self.settings.prio
        if prio.enabled:  # vLLM's priority queue: (priority, arrival_time)
            rank = prio.rank
            self.waiting_queue.sort(key=lambda r: (rank(r), r.arrival_time))

    # --- one step ------------------------------------------------------------------------------
    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        self.intake.apply_aborts()
        self.intake.abort_timed_out()
        running = self.running_batch.reqs = [r for r in self.running_batch.reqs if not r.finished()]
        budget = self.args.max_num_batched_tokens
        scheduled: list[Req] = []
        num_new: dict[int, int] = {}  # id(req) -> tokens this step
        slots: dict[int, int] = {}  # id(req) -> KV slots this step
        needed = 0  # KV slots all of this step's scheduled requests take
        preempted = False

        # 1. running requests
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            n = self._cap(req.num_tokens - req.num_computed_tokens, budget)
            if n <= 0:
                i += 1
                continue
            s = self.kv.slots_for(req, n)
            can_schedule = True
            while needed + s > self.kv.reclaimable_size():
                victim = self._select_preempt_target(running)
                j = running.index(victim)
                running.pop(j)
                if id(victim) in num_new:  # scheduled earlier this step: give its share back
                    scheduled.remove(victim)
                    budget += num_new.pop(id(victim))
                    needed -= slots.pop(id(victim))
                if j < i:
                    i -= 1
                self._preempt(victim)
                preempted = True
                if victim is req:
                    can_schedule = False
                    break
            if not can_schedule:
                break
            scheduled.append(req)
            num_new[id(req)], slots[id(req)] = n, s
            needed += s
            budget -= n
            i += 1

        # 2. waiting requests (not in a step that preempted)
        if not preempted and self.waiting_queue:
            self._order_waiting()
            held = len(self.outputs.held)  # ended, their slots free once the forward in flight is done
            while self.waiting_queue and budget > 0 and len(running) + held < self.max_num_seqs:
                req = self.waiting_queue[0]
                self.kv.match(req)
                n = self._cap(req.extend_input_len, budget)
                self.kv.lock_match(req)  # the match must survive this step's evictions
                s = self.kv.slots_for(req, n, held=len(req.prefix_indices))
                if needed + s > self.kv.reclaimable_size():
                    self.kv.unlock_match(req)
                    break
                self.waiting_queue.pop(0)
                self.admit(req)
                running.append(req)
                scheduled.append(req)
                num_new[id(req)], slots[id(req)] = n, s
                needed += s
                budget -= n

        if not scheduled:
            return None
        # 3. one forward for all of them
        batch = ScheduleBatch(scheduled, ForwardMode.MIXED)
        all_decode = True
        for req in scheduled:
            n = num_new[id(req)]
            start = req.num_computed_tokens
            decode = n == 1 and start >= req.prompt_len and start + 1 == req.num_tokens
            all_decode = all_decode and decode
            if decode:
                batch.num_decode += 1
            else:
                self.stats.prefill_tokens += n
            req.extend_input_len = n
            req.is_chunked = start + n < req.num_tokens
            batch.prefix_lens.append(start)
            batch.extend_lens.append(n)
            batch.out_slots.extend(self.kv.grow(req, n))
        if all_decode:
            batch.forward_mode = ForwardMode.DECODE
        return batch

    def has_work(self) -> bool:
        return bool(self.queues.waiting or self.queues.running.reqs or self.in_flight or self.outputs.held
                    or self.grammars.pending)

    def can_build_ahead(self, running: InFlight) -> bool:
        """Never: every step may preempt, and a victim could be a request in flight. The overlap
        loop still runs each forward on the forward thread while results go out and requests come in."""
        return False
