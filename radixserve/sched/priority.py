"""Request priorities: intake checks, the queue cap, the queue timeout and preemption.

SGLang's rules (seed 000, sections 2.1, 3.1 and 4.4), shared by both schedulers:

- ``--enable-priority-scheduling``: the priority orders the waiting queue (arrival time breaks
  ties); a larger value is more important, a smaller one with
  ``--schedule-low-priority-values-first``. A request without a priority gets
  ``--default-priority-value``, or else the least important value there is (SGLang's
  ``sys.maxsize`` / ``-sys.maxsize - 1``).
- Without it, a priority is accepted and ignored, or refused (400) with
  ``--abort-on-priority-when-disabled``.
- ``--max-queued-requests``: a full queue refuses a newcomer (429), unless priority scheduling is
  on and the newcomer is strictly more important than the least important queued request (the
  latest queued among equals): that one is aborted (429) and the newcomer queued.
- Preemption (``preempt_for``): a waiting request that cannot get a slot in the running batch, or
  KV memory, takes it from running requests it beats by more than
  ``--priority-scheduling-preemption-threshold``, least important (then latest arrival) first.
  A victim's KV goes to the radix cache (``KVManager.release``) and it returns to the waiting
  queue, to resume mostly from cache.
- ``--queue-timeout``: a request not scheduled within that many seconds of queueing is aborted
  (503, code ``queue_timeout``).

Under ``--scheduler unified`` priority means vLLM's ``--scheduling-policy priority``: a smaller value
is more important (vLLM's convention) and a missing priority is 0; preemption there is vLLM's
(``UnifiedScheduler``), not ``preempt_for``.

Functions take the scheduler as their first argument so ``scheduler.py`` only calls them.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from radixserve.config import ServerArgs
from radixserve.sched.aging import aged_rank
from radixserve.sched.finish import FINISH_ABORT
from radixserve.sched.prefill_adder import AddReqResult, PrefillAdder
from radixserve.sched.req import Req
from radixserve.sched.thrash import exclusive_cached_tokens, may_be_victim, preemption_key

if TYPE_CHECKING:
    from radixserve.sched.scheduler import Scheduler


@dataclass(frozen=True)
class PrioritySettings:
    enabled: bool = False
    low_values_first: bool = False
    default: int = 0
    preemption_threshold: int = 10
    abort_when_disabled: bool = False

    @classmethod
    def from_args(cls, args: ServerArgs) -> PrioritySettings:
        if args.scheduler == "unified":  # vLLM: smaller is more important, 0 by default
            low, enabled = True, args.scheduling_policy == "priority"
            default = 0 if args.default_priority_value is None else args.default_priority_value
        else:
            low, enabled = args.schedule_low_priority_values_first, args.enable_priority_scheduling
            if args.default_priority_value is not None:
                default = args.default_priority_value
            else:  # SGLang: the least important value there is
                default = sys.maxsize if low else -sys.maxsize - 1
        return cls(enabled, low, default, args.priority_scheduling_preemption_threshold,
                   args.abort_on_priority_when_disabled)

    def rank(self, req: Req) -> int:
        """Smaller is more important; 0 for everyone when priorities are off."""
        if not self.enabled:
            return 0
        p = self.default if req.priority is None else req.priority
        return p if self.low_values_first else -p


# --- intake --------------------------------------------------------------------------------------
def check_priority(sched: Scheduler, req: Req) -> FINISH_ABORT | None:
    s = sched.prio
    if req.priority is not None and (isinstance(req.priority, bool) or not isinstance(req.priority, int)):
        return FINISH_ABORT(f"priority must be an integer, got {req.priority!r}", param="priority")
    if not s.enabled:
        if req.priority is not None and s.abort_when_disabled:
            how = ("--scheduling-policy priority" if sched.args.scheduler == "unified"
                   else "--enable-priority-scheduling")
            return FINISH_ABORT(
                f"this server does not schedule by priority ({how} is off) and refuses requests that "
                "carry one (--abort-on-priority-when-disabled); send the request without a priority",
                status_code=400, code="priority_disabled", param="priority",
            )
        return None
    if req.priority is None:
        req.priority = s.default
    return None


def check_queue_cap(sched: Scheduler, req: Req) -> FINISH_ABORT | None:
    """Room in the waiting queue for ``req``: refuse it, or abort a less important queued one."""
    cap = sched.args.max_queued_requests
    queue = sched.waiting_queue
    if cap is None or len(queue) < cap:
        return None
    if sched.prio.enabled and queue:
        rank = sched.prio.rank
        i = max(range(len(queue)), key=lambda j: (rank(queue[j]), queue[j].arrival_time, j))
        victim = queue[i]
        if rank(req) < rank(victim):
            del queue[i]
            sched.kv.release(victim)
            sched._finish(victim, FINISH_ABORT(
                f"the request queue is full (max_queued_requests={cap}) and this request was the least "
                f"important in it (priority {victim.priority}); a more important one (priority "
                f"{req.priority}) took its place",
                status_code=429, err_type="rate_limit_error", code="queue_full_preempted",
            ))
            return None
    return FINISH_ABORT(
        f"too many queued requests (max_queued_requests={cap}); retry later",
        status_code=429, err_type="rate_limit_error", code="queue_full",
    )


def abort_timed_out(sched: Scheduler) -> None:
    """Abort the waiting requests that were never scheduled within ``--queue-timeout`` seconds. A
    preempted or retracted request (already partly served) is not timed out."""
    timeout = sched.args.queue_timeout
    if timeout is None or not sched.waiting_queue:
        return
    now = sched.clock()
    expired = [
        r for r in sched.waiting_queue
        if not r.admitted_before and r.queue_entry_time is not None and now - r.queue_entry_time > timeout
    ]
    if not expired:
        return
    gone = {id(r) for r in expired}
    sched.waiting_queue = [r for r in sched.waiting_queue if id(r) not in gone]
    for r in expired:
        sched.kv.release(r)
        sched._finish(r, FINISH_ABORT(
            f"the request waited {now - r.queue_entry_time:.1f}s to be scheduled "  # type: ignore[operator]
            f"(queue_timeout={timeout}s); the server is overloaded, retry later",
            status_code=503, err_type="server_error", code="queue_timeout",
        ))


# --- preemption (the sglang scheduler) ------------------------------------------------------------
def preempt_for(sched: Scheduler, req: Req, adder: PrefillAdder, victims: list[Req], need_slot: bool) -> bool:
    """Make room for ``req`` (a request slot if ``need_slot``, and the KV budget ``add_one_req``
    asks for) by preempting running requests it beats by more than the threshold, least important
    and then latest arrival first, as few as cover the need. Returns whether it preempted; nothing
    is preempted when the candidates could not cover the need."""
    s = sched.prio
    running = sched.running_batch.reqs
    if not s.enabled or not running:
        return False
    now = sched.clock()
    mine = aged_rank(sched, req, now, horizon=False)
    cands = sorted(  # thrash.py: the per-request cap, then the victim order
        (r for r in running if aged_rank(sched, r, now) - mine > s.preemption_threshold and r.to_abort is None
         and may_be_victim(sched, r)),
        key=lambda r: preemption_key(sched, r),
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
        need_tokens -= (min(r.remaining_new_tokens, clip) * ratio + len(r.kv_indices) - r.cache_protected_len
                        + exclusive_cached_tokens(sched, r))
    if not chosen or need_tokens > 0 or need_slots > 0:
        return False
    gone = {id(r) for r in chosen}
    sched.running_batch.reqs = [r for r in running if id(r) not in gone]
    for r in chosen:
        adder.rem_total_token_offset -= min(r.remaining_new_tokens, clip) * ratio
        sched.kv.release(r)  # computed KV -> radix cache; resumes mostly as a cache hit
        r.reset_for_retract()
        r.num_preemptions += 1
        sched.stats.by_class.add(r, "preemptions")
        victims.append(r)
    adder.available_tokens = sched.kv.available_size()
    sched.stats.num_preemptions += len(chosen)
    sched.ext.note_victims(chosen)
    return True


def add_or_preempt(sched: Scheduler, req: Req, adder: PrefillAdder, victims: list[Req]) -> AddReqResult:
    """``adder.add_one_req(req)``; with priority scheduling, when KV memory is what refused it,
    preempt less important running requests and try once more."""
    n = len(adder.can_run_list)
    res = adder.add_one_req(req)
    if len(adder.can_run_list) > n or res is not AddReqResult.NO_TOKEN or not sched.prio.enabled:
        return res
    if not preempt_for(sched, req, adder, victims, need_slot=False):
        return res
    req.init_next_round_input(sched.tree_cache)
    return adder.add_one_req(req)
