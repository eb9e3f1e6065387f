"""What the live dashboard shows of one scheduler (data-parallel rank): ``rank_snapshot``, built by
the scheduler process between two steps when asked (the ``dashboard`` control op, like
``get_load``), from counters the scheduler keeps anyway (``SchedStats``, its ring of recent step
compositions, the radix cache's eviction counters) and one pass over the unfinished requests to
group them by class. That pass costs O(requests) once per poll (about once a second per open
page), never per step. The HTTP side of the dashboard is ``frontend/recent_requests.py`` and the
routes ``frontend/admin_api.py``; the page is in ``radixserve/dashboard/static`` (docs/dashboard.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixserve.sched.core import SchedulerCore
    from radixserve.sched.req import Req

MAX_TENANT_ROWS = 20  # tenants listed by name per table; the rest are summed as "other"


def _classes(reqs: list[Req], low_first: bool, held: bool) -> dict[str, list[list[Any]]]:
    """``reqs`` counted by priority (``[priority, requests, tokens]``, the most important first:
    the largest value, or the smallest with ``low_first``; none last) and by tenant (``[tenant,
    requests, tokens]``, the most requests first, past ``MAX_TENANT_ROWS`` summed as ``"other"``).
    Tokens: ``held`` False, what the requests still have to compute (a waiting request's prompt
    less what was already computed); ``held`` True, the KV slots they hold (a prefix several share counts for each)."""
    by_prio: dict[int | None, list[int]] = {}
    by_tenant: dict[str, list[int]] = {}
    for r in reqs:
        todo = len(r.kv_indices) if held else r.num_tokens - r.num_computed_tokens
        row = by_prio.setdefault(r.priority, [0, 0])
        row[0] += 1
        row[1] += todo
        row = by_tenant.setdefault(r.tenant or "", [0, 0])
        row[0] += 1
        row[1] += todo
    sign = 1 if low_first else -1
    prio: list[list[Any]] = [[p, n, t] for p, (n, t) in
                             sorted(by_prio.items(), key=lambda kv: (kv[0] is None, sign * (kv[0] or 0)))]
    order = sorted(by_tenant.items(), key=lambda kv: (-kv[1][0], kv[0]))
    if len(order) > MAX_TENANT_ROWS:
        rest = order[MAX_TENANT_ROWS - 1 :]
        order = order[: MAX_TENANT_ROWS - 1] + [("other", [sum(r[0] for _, r in rest), sum(r[1] for _, r in rest)])]
    tenants: list[list[Any]] = [[t, n, k] for t, (n, k) in order]
    return {"by_priority": prio, "by_tenant": tenants}


def _speculation(sched: SchedulerCore) -> dict[str, Any] | None:
    """Speculative decoding's counters since start, the settings the scheduler drafts under and,
    for n-gram drafts, the acceptance it has learned by match class (short, medium, long); None
    when speculation is off."""
    spec = sched.parts.spec
    if spec is None:
        return None
    s = spec.stats
    return {"algorithm": sched.settings.args.speculative_algorithm, "num_draft_tokens": spec.max_k,
            "max_batch_size": spec.max_batch_size, "verify_steps": s.verify_steps, "verify_rows": s.verify_rows,
            "draft_tokens": s.draft_tokens, "accepted_tokens": s.accepted_tokens,
            "accept_rate": s.accepted_tokens / s.draft_tokens if s.draft_tokens else None,
            "accept_length": (s.verify_rows + s.accepted_tokens) / s.verify_rows if s.verify_rows else None,
            "class_acceptance": None if spec.by_runner else [round(a, 3) for a in spec.match_alpha]}


def rank_snapshot(sched: SchedulerCore, dp_rank: int = 0) -> dict[str, Any]:
    """One rank's figures for the dashboard; runs in the scheduler process between steps.
    ``load`` is exactly what ``/get_load`` answers at the same moment."""
    from radixserve.sched.policies import policy_names  # scheduler side only: the HTTP process has no torch

    q, kv, st = sched.queues, sched.kv, sched.stats
    # not running: the waiting queue, and requests parked before it (a grammar compiling, a prefix loading)
    waiting_ids = {id(r) for r in (*q.waiting, *sched.grammars.pending, *(kv.tier.parked_reqs() if kv.tier else ()))}
    running = [r for r in q.by_rid.values() if id(r) not in waiting_ids]
    free = kv.available_size()
    evictable = kv.evictable_size()
    evicted = kv.evicted()
    a = sched.settings.args
    low_first = a.schedule_low_priority_values_first
    return {
        "dp_rank": dp_rank,
        "load": {"dp_rank": dp_rank, **sched.get_load()},
        "policy": a.scheduling_policy if a.scheduler == "unified" else a.schedule_policy,
        "scheduler": a.scheduler,
        "policies": policy_names(),
        "waiting": {"requests": len(q.waiting), **_classes(q.waiting, low_first, held=False)},
        "running": {"requests": len(running), "max": q.max_running_requests,
                    "chunked": q.chunked is not None, **_classes(running, low_first, held=True)},
        "kv": {"total": kv.total_tokens, "used": kv.total_tokens - free - evictable, "evictable": evictable,
               "free": free, "usage": kv.usage(), "req_slots_free": kv.req_to_token_pool.available_size(),
               "req_slots_total": kv.req_to_token_pool.size},
        "cache": {"radix": not a.disable_radix_cache, "size": evictable + kv.protected_size(), "evictable": evictable,
                  "protected": kv.protected_size(), "hit_rate": st.cache_hit_rate,
                  "prompt_tokens": st.prompt_tokens, "cached_tokens": st.cached_tokens,
                  "evicted_tokens": evicted[0], "evicted_nodes": evicted[1]},
        "counters": {"forward_steps": st.forward_steps, "prefill_steps": st.prefill_steps,
                     "decode_steps": st.decode_steps, "prefill_tokens": st.prefill_tokens,
                     "generated_tokens": st.generated_tokens, "finished": st.num_finished,
                     "aborted": st.num_aborted, "preemptions": st.num_preemptions,
                     "retractions": st.num_retractions, "starved": st.num_starved,
                     "deadline_rejected": st.num_deadline_rejected},
        # oldest first: [mode, requests, prefill tokens, decode tokens, seconds]
        "steps": [list(s) for s in st.recent_steps],
        "spec": _speculation(sched),
        "tier": kv.tier.snapshot() if kv.tier is not None else None,
    }
