"""Deadlines: ``edf`` ordering and ``--deadline-admission``.

``Req.deadline`` is an absolute TTFT deadline on the scheduler clock (the server sets it to
arrival + ``deadline_ms``/``x-ttft-slo-ms``/``ttft_slo_ms`` / 1000; the simulator sets it directly).

``edf``: earliest deadline first; requests without one go last, first come first served among them,
and so does a request whose deadline has already passed. Serving a late request first would only
push the requests behind it past their deadlines too (the EDF domino effect under overload).

``--deadline-admission``: at arrival, a request with a deadline is refused (429, code
``deadline_unmeetable``) when

    now + tokens_ahead / prefill_tokens_per_s > deadline

where ``tokens_ahead`` is its own uncached prompt plus the tokens still to prefill of every waiting
request at or before it in deadline order (and of the request being chunked), and
``prefill_tokens_per_s`` starts at ``--deadline-prefill-tokens-per-s`` and follows an EMA (alpha
0.2) of the measured prefill steps of ``SchedulerStats.step_log`` (steps of at least 32 tokens).
The estimate ignores decode steps interleaved with prefill and so is optimistic under heavy decode.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixserve.mem.radix_cache import RadixCache
from radixserve.sched.finish import FINISH_ABORT
from radixserve.sched.policy import PolicyContext, SchedulePolicy, register_policy
from radixserve.sched.req import Req

if TYPE_CHECKING:
    from radixserve.sched.schedule_batch import ScheduleBatch
    from radixserve.sched.scheduler import Scheduler

EMA_ALPHA = 0.2
MIN_SAMPLE_TOKENS = 32
INF = float("inf")


def deadline_of(req: Req) -> float | None:
    return getattr(req, "deadline", None)


@register_policy
class EarliestDeadlineFirst(SchedulePolicy):
    name = "edf"

    def order(self, waiting: list[Req], ctx: PolicyContext) -> list[Req]:
        now = ctx.now

        def key(r: Req) -> tuple[int, float, float]:
            d = deadline_of(r)
            # NOTE: a request whose deadline has passed has none left to meet: it joins the requests
            # without one (first come, first served) instead of pushing the others past theirs
            return (ctx.priority_key(r), INF if d is None or d < now else d, r.arrival_time)

        return sorted(waiting, key=key)


class PrefillThroughput:
    """EMA of measured prefill tokens per second."""

    def __init__(self, initial: float) -> None:
        self.tokens_per_s = initial

    def observe(self, batch: ScheduleBatch, sched: Scheduler) -> None:
        if not batch.forward_mode.is_extend() or not sched.stats.step_log:
            return
        _, _, tokens, wall = sched.stats.step_log[-1]
        if tokens >= MIN_SAMPLE_TOKENS and wall > 0:
            self.tokens_per_s += EMA_ALPHA * (tokens / wall - self.tokens_per_s)


def _uncached_tokens(sched: Scheduler, req: Req) -> int:
    if req.kv_indices:
        return req.num_tokens - req.num_computed_tokens
    ids = req.fill_ids
    tree = sched.tree_cache
    cached = tree.peek_prefix(ids[: len(ids) - 1], req.extra_key)[2] if isinstance(tree, RadixCache) else 0
    return len(ids) - cached


def check_deadline(sched: Scheduler, req: Req) -> FINISH_ABORT | None:
    d = deadline_of(req)
    if not sched.args.deadline_admission or d is None:
        return None
    now = sched.clock()
    ahead = _uncached_tokens(sched, req)
    for r in sched.waiting_queue:
        rd = deadline_of(r)
        if rd is not None and rd <= d:
            ahead += r.num_tokens  # a waiting request's cache hit is not known until it is matched
    if sched.chunked_req is not None:
        ahead += sched.chunked_req.num_tokens - sched.chunked_req.num_computed_tokens
    tps = sched.ext.throughput.tokens_per_s
    eta = now + ahead / tps
    if eta <= d:
        return None
    sched.stats.num_deadline_rejected += 1
    return FINISH_ABORT(
        f"the deadline cannot be met: {ahead} prompt tokens are ahead of this request's first token in "
        f"deadline order, about {ahead / tps * 1000:.0f} ms at {tps:.0f} prefill tokens/s, but only "
        f"{max(d - now, 0.0) * 1000:.0f} ms are left; retry later or with a later deadline",
        status_code=429, err_type="rate_limit_error", code="deadline_unmeetable", param="deadline_ms",
    )
