"""Decode retraction (``Scheduler.retract_decode``): when the next decode step cannot get KV slots,
send running requests back to the waiting queue until the rest have headroom.

Victims come off the end of ``thrash.retract_order`` (SGLang's order by default: fewest output
tokens first, the longest prompt among equals; requests at ``--max-preemptions-per-request`` only
when nothing else is left). A victim's computed KV goes to the radix cache, so its recompute is
mostly a cache hit if that survives. The survivors must be able to decode
``--retract-decode-steps`` more steps.

``new_token_ratio`` is then raised, never lowered: it becomes the larger of its current value and
SGLang's estimate from the survivors, ``min(1, (decoded + steps * bs) / (max_new + 1))``, and the
scheduler decays it back towards its floor by one step each decode step
(``Scheduler.update_running_batch``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from radixserve.sched.finish import FINISH_ABORT
from radixserve.sched.req import Req
from radixserve.sched.thrash import retract_order

if TYPE_CHECKING:
    from radixserve.sched.schedule_batch import ScheduleBatch
    from radixserve.sched.scheduler import Scheduler

logger = logging.getLogger(__name__)


def retract_decode(sched: Scheduler, batch: ScheduleBatch) -> list[Req]:
    """Retract from ``batch`` as described above; returns the requests sent back to the queue (a
    lone request that still cannot decode is aborted with ``out_of_memory`` instead)."""
    kv = sched.kv
    reqs = retract_order(sched, batch.reqs)  # the last one is the first victim
    retracted: list[Req] = []
    steps = max(sched.args.retract_decode_steps, 1)
    first = True
    while first or kv.decode_tokens_needed(reqs, steps) > kv.reclaimable_size():
        if len(reqs) == 1:
            if kv.decode_tokens_needed(reqs) > kv.reclaimable_size():
                victim = reqs.pop()
                kv.release(victim)
                sched._finish(victim, FINISH_ABORT(
                    "out of KV memory with a single request running", status_code=500,
                    err_type="server_error", code="out_of_memory"))
            break
        first = False
        victim = reqs.pop()
        kv.release(victim)
        victim.reset_for_retract()
        victim.num_retractions += 1
        retracted.append(victim)
    sched.stats.num_retractions += len(retracted)
    for victim in retracted:
        sched.stats.by_class.add(victim, "retractions")
    kept = {id(r) for r in reqs}
    batch.reqs = [r for r in batch.reqs if id(r) in kept]
    sched.waiting_queue.extend(retracted)
    sched.ext.note_victims(retracted)
    total_decoded = sum(len(r.output_ids) for r in batch.reqs)
    total_max_new = sum(r.max_new_tokens for r in batch.reqs)
    estimate = min(1.0, (total_decoded + steps * len(batch.reqs)) / (total_max_new + 1))
    sched.new_token_ratio = max(sched.new_token_ratio, estimate)
    if retracted:
        logger.info("retracted %d requests; new_token_ratio=%.3f", len(retracted), sched.new_token_ratio)
    return retracted
