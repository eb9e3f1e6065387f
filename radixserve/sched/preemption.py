"""``Preemption``: taking KV and batch slots back from running requests.

``evict`` is preemption by recompute, shared by both builders.

Priority preemption (the sglang scheduler, ``--enable-priority-scheduling``): a waiting request
that cannot get a slot in the running batch, or KV memory, takes it from running requests it beats
by more than ``--priority-scheduling-preemption-threshold`` (aged ranks, ``ordering.py``), least
important (then latest arrival) first, as few as cover the need. A victim's KV goes to the radix
cache (``KVManager.release``) and it returns to the waiting queue, to resume mostly from cache.
The per-request cap and the victim order are ``thrash.py``'s.

Decode retraction (``retract_decode``): when the next decode step cannot get KV slots, running
requests go back to the waiting queue until the rest have headroom. Victims come off the end of
``thrash.retract_order`` (SGLang's order by default: fewest output tokens first, the longest
prompt among equals; requests at ``--max-preemptions-per-request`` only when nothing else is
left). The survivors must be able to decode ``--retract-decode-steps`` more steps. It returns
SGLang's new estimate of ``new_token_ratio`` from the survivors,
``min(1, (decoded + steps * bs) / (max_new + 1))``, which the scheduler takes when it is larger.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from radixserve.sched.finish import FINISH_ABORT
from radixserve.sched.kv_manager import KVManager
from radixserve.sched.ordering import Ordering, ReturnedVictims
from radixserve.sched.output import Outputs
from radixserve.sched.prefill_adder import AddReqResult, PrefillAdder
from radixserve.sched.req import Req
from radixserve.sched.schedule_batch import ScheduleBatch
from radixserve.sched.settings import SchedSettings
from radixserve.sched.state import Queues
from radixserve.sched.stats import SchedStats
from radixserve.sched.thrash import may_be_victim, preemption_key, retract_order

logger = logging.getLogger(__name__)


class Preemption:
    def __init__(
        self, settings: SchedSettings, queues: Queues, kv: KVManager, stats: SchedStats, outputs: Outputs,
        ordering: Ordering, victims: ReturnedVictims, clock: Callable[[], float],
    ) -> None:
        self.settings = settings
        self.queues = queues
        self.kv = kv
        self.stats = stats
        self.outputs = outputs
        self.ordering = ordering
        self.victims = victims
        self.clock = clock

    # --- priority preemption -------------------------------------------------------------------
    def preempt_for(self, req: Req, adder: PrefillAdder, victims: list[Req], need_slot: bool) -> bool:
        """Make room for ``req`` (a request slot if ``need_slot``, and the KV budget ``add_one_req``
        asks for) by preempting running requests it beats by more than the threshold, least
        important and then latest arrival first, as few as cover the need. Returns whether it
        preempted; nothing is preempted when the candidates could not cover the need."""
        s = self.settings
        prio, args = s.prio, s.args
        running = self.queues.running.reqs
        if not prio.enabled or not running:
            return False
        now = self.clock()
        rank = self.ordering.aged_rank
        mine = rank(req, now, use_horizon=False)
        cap, vp, kv = args.max_preemptions_per_request, args.retract_victim_policy, self.kv
        cands = sorted(  # thrash.py: the per-request cap, then the victim order
            (r for r in running if rank(r, now) - mine > prio.preemption_threshold and r.to_abort is None
             and may_be_victim(r, cap)),
            key=lambda r: preemption_key(r, kv, vp, prio),
        )
        ratio, clip = adder.new_token_ratio, adder.clip
        need_tokens = req.extend_input_len + min(req.remaining_new_tokens, clip) - adder.rem_total_tokens + 1
        need_slots = 1 if need_slot else 0
        chosen: list[Req] = []
        for r in cands:
            if need_tokens <= 0 and need_slots <= 0:
                break
            chosen.append(r)
            need_slots -= 1
            need_tokens -= (min(r.remaining_new_tokens, clip) * ratio + r.own_kv_tokens
                            + kv.exclusive_cached_tokens(r))
        if not chosen or need_tokens > 0 or need_slots > 0:
            return False
        gone = {id(r) for r in chosen}
        self.queues.running.reqs = [r for r in running if id(r) not in gone]
        for r in chosen:
            self.evict(r)
            victims.append(r)
        adder.give_back(chosen, kv.available_size())
        self.victims.note(chosen)
        return True

    def evict(self, req: Req) -> None:
        """Preempt a running ``req`` by recompute: its computed KV goes to the radix cache (so it
        resumes mostly as a cache hit) and it is a waiting request again; the caller queues it."""
        self.kv.release(req)
        req.reset_for_retract()
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.stats.by_class.add(req, "preemptions")

    def add_or_preempt(self, req: Req, adder: PrefillAdder, victims: list[Req]) -> AddReqResult:
        """``adder.add_one_req(req)``; with priority scheduling, when KV memory is what refused it,
        preempt less important running requests and try once more."""
        n = len(adder.can_run_list)
        res = adder.add_one_req(req)
        if len(adder.can_run_list) > n or res is not AddReqResult.NO_TOKEN or not self.settings.prio.enabled:
            return res
        if not self.preempt_for(req, adder, victims, need_slot=False):
            return res
        self.kv.match(req)
        return adder.add_one_req(req)

    # --- decode retraction ---------------------------------------------------------------------
    def retract_decode(self, batch: ScheduleBatch) -> tuple[list[Req], float]:
        """Retract from ``batch`` as described above. Returns the requests sent back to the queue
        (a lone request that still cannot decode is aborted with ``out_of_memory`` instead) and the
        survivors' ``new_token_ratio`` estimate."""
        kv, args = self.kv, self.settings.args
        reqs = retract_order(batch.reqs, kv, args.retract_victim_policy, args.max_preemptions_per_request)
        retracted: list[Req] = []
        steps = max(args.retract_decode_steps, 1)
        first = True
        while first or kv.decode_tokens_needed(reqs, steps) > kv.reclaimable_size():
            if len(reqs) == 1:
                if kv.decode_tokens_needed(reqs) > kv.reclaimable_size():
                    self.outputs.end(reqs.pop(), FINISH_ABORT(
                        "out of KV memory with a single request running", status_code=500,
                        err_type="server_error", code="out_of_memory"))
                break
            first = False
            victim = reqs.pop()
            kv.release(victim)
            victim.reset_for_retract()
            victim.num_retractions += 1
            retracted.append(victim)
        self.stats.num_retractions += len(retracted)
        for victim in retracted:
            self.stats.by_class.add(victim, "retractions")
        kept = {id(r) for r in reqs}
        batch.reqs = [r for r in batch.reqs if id(r) in kept]
        self.queues.waiting.extend(retracted)
        self.victims.note(retracted)
        total_decoded = sum(len(r.output_ids) for r in batch.reqs)
        total_max_new = sum(r.max_new_tokens for r in batch.reqs)
        estimate = min(1.0, (total_decoded + steps * len(batch.reqs)) / (total_max_new + 1))
        if retracted:
            logger.info("retracted %d requests", len(retracted))
        return retracted, estimate
