"""``TokenBudget`` (``--scheduler unified``): vLLM V1's ``schedule()`` over radixserve's KV, as a
``BatchBuilder``.

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
(``parts.py``); this builder has no ``new_token_ratio`` and no chunked request.
"""

from __future__ import annotations

from radixserve.sched.parts import SchedParts
from radixserve.sched.req import Req
from radixserve.sched.schedule_batch import ForwardMode, ScheduleBatch
from radixserve.sched.spec import set_drafts
from radixserve.sched.spec_ngram import DraftTree


class TokenBudget:
    def __init__(self, parts: SchedParts) -> None:
        self.parts = parts
        self.queues = parts.queues
        self.kv = parts.kv
        a = parts.settings.args
        self.max_num_batched_tokens = a.max_num_batched_tokens
        self.max_num_seqs = parts.queues.max_running_requests
        self.long_prefill_token_threshold = a.long_prefill_token_threshold
        self.preempt_by_priority = a.scheduling_policy == "priority"

    # --- helpers -------------------------------------------------------------------------------
    def _cap(self, n: int, budget: int) -> int:
        t = self.long_prefill_token_threshold
        if 0 < t < n:
            n = t
        return min(n, budget)

    def _select_preempt_target(self, running: list[Req]) -> int:
        if self.preempt_by_priority:  # vLLM: the largest (priority, arrival_time)
            return self.parts.settings.prio.least_important(running)
        return len(running) - 1

    def _order_waiting(self) -> None:
        prio = self.parts.settings.prio
        if prio.enabled:  # vLLM's priority queue: (priority, arrival_time)
            rank = prio.rank
            self.queues.waiting.sort(key=lambda r: (rank(r), r.arrival_time))

    # --- the BatchBuilder contract ----------------------------------------------------------------
    def busy(self, last: ScheduleBatch | None) -> bool:
        return False

    def may_build_ahead(self) -> bool:
        """Never: every step may preempt, and a victim could be a request in flight. The overlap
        loop still runs each forward on the forward thread while results go out and requests come in."""
        return False

    def on_idle(self) -> None:
        return None

    def next_batch(self, last: ScheduleBatch | None) -> ScheduleBatch | None:
        p = self.parts
        p.intake.apply_aborts()
        p.intake.abort_timed_out()
        q = self.queues
        running = q.running.reqs = [r for r in q.running.reqs if not r.finished()]
        plan = _Plan(self.max_num_batched_tokens)
        if not self._schedule_running(plan, running) and q.waiting:  # 2. not in a step that preempted
            self._schedule_waiting(plan, running)
        return self._build(plan) if plan.reqs else None

    def _schedule_running(self, plan: _Plan, running: list[Req]) -> bool:
        """1. Running requests, in order, preempting from the end when KV runs out. Returns whether
        anything was preempted."""
        kv, preempted = self.kv, False
        i = 0
        while i < len(running) and plan.budget > 0:
            req = running[i]
            n = self._cap(req.num_tokens - req.num_computed_tokens, plan.budget)
            if n <= 0:
                i += 1
                continue
            d = self._drafts(plan, req, n, len(running))
            n += len(d.tokens)
            s = kv.slots_for(req, n)
            while plan.needed + s > kv.reclaimable_size():
                j = self._select_preempt_target(running)
                victim = running.pop(j)
                plan.take_back(victim)  # if scheduled earlier this step
                if j < i:
                    i -= 1
                self.parts.preemption.evict(victim)
                self.queues.waiting.insert(0, victim)
                preempted = True
                if victim is req:
                    return True
            plan.add(req, n, s, d)
            i += 1
        return preempted

    def _drafts(self, plan: _Plan, req: Req, n: int, running: int) -> DraftTree:
        """Speculative decoding: a decoding request's draft tokens, within what is left of the token
        budget and of the KV the step may take: draft tokens are tokens of the step like any other."""
        spec = self.parts.spec
        if (spec is None or n != 1 or req.num_computed_tokens < req.prompt_len or not spec.active(running)
                or plan.budget <= 1):
            return DraftTree([], [], [])
        kv = self.kv
        base = kv.slots_for(req, 1)
        room = min(plan.budget - 1, kv.reclaimable_size() - plan.needed - base)
        return spec.draft_one(req, room, lambda r, k: max(kv.slots_for(r, 1 + k) - base, k), running)

    def _schedule_waiting(self, plan: _Plan, running: list[Req]) -> None:
        """2. Waiting requests while the budget, ``--max-num-seqs`` and the KV pool allow."""
        p, kv, waiting = self.parts, self.kv, self.queues.waiting
        self._order_waiting()
        held = p.held_slots()  # ended, their slots free once the forward in flight is done
        while waiting and plan.budget > 0 and len(running) + held < self.max_num_seqs:
            req = waiting[0]
            kv.match(req)
            n = self._cap(req.extend_input_len, plan.budget)
            kv.lock_match(req)  # the match must survive this step's evictions
            s = kv.slots_for(req, n, held=len(req.prefix_indices))
            if plan.needed + s > kv.reclaimable_size():
                kv.unlock_match(req)
                break
            waiting.pop(0)
            p.admit(req)
            running.append(req)
            plan.add(req, n, s)

    def _build(self, plan: _Plan) -> ScheduleBatch:
        """3. One forward for all of them: DECODE when every request decodes one token."""
        batch = ScheduleBatch(plan.reqs, ForwardMode.MIXED)
        all_decode = True
        none = DraftTree([], [], [])
        drafts = [plan.drafts.get(id(req), none) for req in plan.reqs] if plan.drafts else None
        for i, req in enumerate(plan.reqs):
            n = plan.tokens[id(req)]
            start = req.num_computed_tokens
            k = len(drafts[i].tokens) if drafts is not None else 0
            decode = n - k == 1 and start >= req.prompt_len and start + 1 == req.num_tokens
            all_decode = all_decode and decode
            if decode:
                batch.num_decode += 1
            else:
                self.parts.stats.prefill_tokens += n
            req.extend_input_len = n
            req.is_chunked = start + n < req.num_tokens
            batch.prefix_lens.append(start)
            batch.extend_lens.append(n)
            batch.out_slots.extend(self.kv.grow(req, n))
        if all_decode:
            batch.forward_mode = ForwardMode.DECODE
        if drafts is not None and any(d.tokens for d in drafts):
            set_drafts(batch, drafts)
        return batch


class _Plan:
    """A step being planned: its requests, their tokens and KV slots, the budget left. Nothing is
    allocated until ``_build``, so a request preempted while planning holds no KV of this step."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.reqs: list[Req] = []
        self.tokens: dict[int, int] = {}  # id(req) -> tokens this step
        self.slots: dict[int, int] = {}  # id(req) -> KV slots this step
        self.needed = 0  # KV slots all of them take
        self.drafts: dict[int, DraftTree] = {}  # id(req) -> its draft tokens (counted in its tokens)

    def add(self, req: Req, n: int, slots: int, drafts: DraftTree | None = None) -> None:
        self.reqs.append(req)
        self.tokens[id(req)], self.slots[id(req)] = n, slots
        self.needed += slots
        self.budget -= n
        if drafts is not None and drafts.tokens:
            self.drafts[id(req)] = drafts

    def take_back(self, req: Req) -> None:
        if id(req) in self.tokens:
            self.drafts.pop(id(req), None)
            self.reqs.remove(req)
            self.budget += self.tokens.pop(id(req))
            self.needed -= self.slots.pop(id(req))
