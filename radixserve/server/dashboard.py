"""What the live dashboard (``GET /dashboard``) shows, and where each figure comes from (the
routes are in ``http_server.py``; the page in ``radixserve/dashboard/static``).

``GET /dashboard/state`` answers everything the page draws in one call:

- per data-parallel rank, ``rank_snapshot``: built by the scheduler process between two steps (the
  ``dashboard`` control op, like ``get_load``), from counters the scheduler keeps anyway
  (``SchedStats``, its ring of recent step compositions, the radix cache's eviction counters) and
  one pass over the unfinished requests to group them by class. That pass costs O(requests) once
  per poll (about once a second per open page), never per step;
- ``requests``: TTFT and TPOT of the last ``RECENT_REQUESTS`` finished requests, kept by the HTTP
  process as their last output passes through (``RecentRequests``), so the scheduler does nothing
  for them.

``/dashboard`` and its static files are public (they hold no data); ``/dashboard/state`` is behind
``--api-key`` like every other endpoint, and the page sends the key it finds in its URL
(docs/dashboard.md).
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (the HTTP process needs only RecentRequests: no scheduler imports there)
    from radixserve.sched.core import SchedulerCore
    from radixserve.sched.io import OutRow
    from radixserve.sched.req import Req
    from radixserve.server.req_state import ReqState

RECENT_REQUESTS = 100  # finished requests whose TTFT / TPOT the page plots
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


def rank_snapshot(sched: SchedulerCore, dp_rank: int = 0) -> dict[str, Any]:
    """One rank's figures for the dashboard; runs in the scheduler process between steps.
    ``load`` is exactly what ``/get_load`` answers at the same moment."""
    from radixserve.sched.policies import policy_names  # scheduler side only: the HTTP process has no torch

    q, kv, st = sched.queues, sched.kv, sched.stats
    waiting_ids = {id(r) for r in q.waiting}
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
    }


class RecentRequests:
    """TTFT and TPOT of the last ``size`` finished requests (aborted ones are counted, not kept)."""

    def __init__(self, size: int = RECENT_REQUESTS) -> None:
        self.rows: deque[tuple[float, float, float | None, int, int]] = deque(maxlen=size)
        self.aborted = 0

    def add(self, st: ReqState, last: OutRow, now: float) -> None:
        """``st`` finished with ``last`` at ``now`` (perf_counter, as ``st.created``)."""
        if (last.finished_reason is not None and last.finished_reason.is_abort) or st.ttft is None:
            self.aborted += 1
            return
        n = last.completion_tokens
        tpot = (now - st.created - st.ttft) / (n - 1) if n > 1 else None
        self.rows.append((time.time(), st.ttft, tpot, last.prompt_tokens, n))

    def summary(self) -> dict[str, Any]:
        rows = list(self.rows)
        ttfts = [r[1] for r in rows]
        tpots = [r[2] for r in rows if r[2] is not None]
        return {"aborted": self.aborted, "count": len(rows),
                "ttft": percentiles(ttfts), "tpot": percentiles(tpots),
                # oldest first: [finished at (unix s), ttft s, tpot s or null, prompt tokens, output tokens]
                "recent": [list(r) for r in rows]}


def percentiles(xs: list[float]) -> dict[str, float | None]:
    """p50 / p90 / p99 / max by the nearest rank (None when empty)."""
    if not xs:
        return {"p50": None, "p90": None, "p99": None, "max": None}
    s = sorted(xs)

    def rank(p: float) -> float:
        return s[max(0, math.ceil(len(s) * p / 100) - 1)]

    return {"p50": rank(50), "p90": rank(90), "p99": rank(99), "max": s[-1]}
