"""Thrash-free preemption and retraction: a per-request cap and the victim order.

- ``--max-preemptions-per-request`` (default 3; 0 turns the guard off): a request preempted
  (priority) or retracted (decode out of KV) that many times in total is no longer chosen as a
  victim. Preemption simply skips it; decode retraction takes it only when no other request is
  left to retract (the alternative would be running out of KV memory). While the guard is on, a
  returned victim keeps its place at the front of its class (``ordering.py``).
- ``--retract-victim-policy``: ``sglang`` (default) retracts as SGLang does, fewest output tokens
  first, the longest prompt among equals; ``min-recompute`` retracts the request with the least
  recompute cost first (SGLang's order among equals), and priority preemption picks, among the
  least important candidates, the cheapest first.

Recompute cost: a victim's KV goes to the radix cache when it is released, unlocked: under the
memory pressure that caused the retraction it is the first thing eviction takes, so it is what the
victim will likely recompute. That is its own KV beyond ``cache_protected_len`` plus the cached
tokens only it pins (``lock_ref`` 1); a prefix shared with other running requests stays pinned.
A returned victim keeps its ``queue_entry_time`` and, with the guard on or under ``min-recompute``,
goes first in its priority class (``ordering.py``). With the guard off (0) and ``sglang``, victims are
chosen and re-queued as SGLang does: the policy puts them back wherever its key says.
"""

from __future__ import annotations

from radixserve.sched.kv_manager import KVManager
from radixserve.sched.priority import PrioritySettings
from radixserve.sched.req import Req


def times_victimized(req: Req) -> int:
    return req.num_preemptions + req.num_retractions


def may_be_victim(req: Req, cap: int) -> bool:
    """``cap``: ``--max-preemptions-per-request`` (0: no cap)."""
    return cap <= 0 or times_victimized(req) < cap


def recompute_cost(req: Req, kv: KVManager) -> int:
    """Tokens that become evictable when ``req`` lets go: its own KV beyond ``cache_protected_len``
    plus the cached tokens only it pins (radix nodes with ``lock_ref`` 1 on its path). What other
    running requests share stays pinned and costs nothing to get back."""
    return max(req.num_computed_tokens - req.cache_protected_len, 0) + kv.exclusive_cached_tokens(req)


def retract_order(reqs: list[Req], kv: KVManager, victim_policy: str, cap: int) -> list[Req]:
    """The running requests in retraction order: the *last* is retracted first."""
    out = sorted(reqs, key=lambda r: (len(r.output_ids), -r.prompt_len), reverse=True)  # SGLang's
    if victim_policy == "min-recompute":
        out.sort(key=lambda r: recompute_cost(r, kv), reverse=True)  # stable: SGLang's order among equal costs
    capped = [r for r in out if not may_be_victim(r, cap)]
    if capped:  # retracted only when nothing else is left
        out = capped + [r for r in out if may_be_victim(r, cap)]
    return out


def preemption_key(req: Req, kv: KVManager, victim_policy: str, prio: PrioritySettings) -> tuple[int, int, float]:
    """Sort key of preemption candidates, first victim first: least important, then (min-recompute)
    cheapest to recompute, then latest arrival."""
    cost = recompute_cost(req, kv) if victim_policy == "min-recompute" else 0
    return (-prio.rank(req), cost, -req.arrival_time)
