"""``sjf``: shortest job first, by an estimate of the work a request still needs.

    size = uncached prompt tokens + min(max_new_tokens, --clip-max-new-tokens) * --sjf-output-weight

Uncached prompt tokens come from a read-only radix match (``RadixCache.peek_prefix_len``; the
whole prompt without a radix cache). Short-first starves long requests under a steady stream of short
ones; pair it with ``--priority-aging-horizon`` / ``--priority-aging-rate`` (``ordering.py``).
"""

from __future__ import annotations

from typing import Any

from radixserve.sched.policies.base import PolicyContext, SchedulePolicy
from radixserve.sched.req import Req


class ShortestJobFirst(SchedulePolicy):
    name = "sjf"

    def __init__(self) -> None:
        self.output_weight = 1.0
        self.clip = 4096

    def configure(self, args: Any, **params: Any) -> None:
        self.output_weight = float(params.pop("output_weight", args.sjf_output_weight))
        self.clip = args.clip_max_new_tokens
        if params:
            raise ValueError(f"sjf takes no parameters {sorted(params)}")

    def job_size(self, req: Req, ctx: PolicyContext) -> float:
        tree = ctx.prefix_tree
        cached = tree.peek_prefix_len(req.match_key()) if tree is not None else 0
        return len(req.fill_ids) - cached + min(req.remaining_new_tokens, self.clip) * self.output_weight

    def order(self, waiting: list[Req], ctx: PolicyContext) -> list[Req]:
        return sorted(waiting, key=lambda r: (ctx.priority_key(r), self.job_size(r, ctx), r.arrival_time))
