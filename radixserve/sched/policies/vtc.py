"""``vtc``: Virtual Token Counter fairness over tenants (Sheng et al., "Fairness in Serving Large
Language Models", OSDI 2024).

Each tenant has a counter of the service it received, weighted:

    counter += (w_p * input tokens computed + w_q * output tokens generated) / tenant weight

(``--vtc-input-weight`` w_p = 1, ``--vtc-output-weight`` w_q = 2, ``--tenant-weights a=2,b=1``;
unlisted tenants weigh 1). Counters are charged after each forward step (``on_batch``). The order
given to the adder repeatedly takes the backlogged tenant with the smallest counter and its oldest
request, charging a simulated copy of the counter with that request's prompt, so one batch
interleaves tenants. A tenant that becomes backlogged again has its counter lifted to the smallest
counter of the tenants already backlogged, so idling banks no credit. Backlogged tenants thus get
weighted-token shares in proportion to their weights, whatever their request rates.

The tenant is ``Req.tenant`` (the OpenAI ``user`` field or an ``x-tenant`` header); requests
without one share the tenant ``""``.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from radixserve.options import parse_tenant_weights
from radixserve.sched.policies.base import PolicyContext, SchedulePolicy
from radixserve.sched.req import Req

if TYPE_CHECKING:
    from radixserve.sched.schedule_batch import ScheduleBatch


def tenant_of(req: Req) -> str:
    return getattr(req, "tenant", None) or ""


class VirtualTokenCounter(SchedulePolicy):
    name = "vtc"

    def __init__(self) -> None:
        self.counters: dict[str, float] = defaultdict(float)
        self.weights: dict[str, float] = {}
        self.w_p = 1.0
        self.w_q = 2.0
        self.backlogged: set[str] = set()

    def configure(self, args: Any, **params: Any) -> None:
        self.weights = parse_tenant_weights(params.pop("tenant_weights", args.tenant_weights))
        self.w_p = float(params.pop("input_weight", args.vtc_input_weight))
        self.w_q = float(params.pop("output_weight", args.vtc_output_weight))
        if params:
            raise ValueError(f"vtc takes no parameters {sorted(params)}")

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def _lift(self, now_backlogged: set[str]) -> None:
        stayed = now_backlogged & self.backlogged
        if stayed:
            floor = min(self.counters[t] for t in stayed)
            for t in now_backlogged - self.backlogged:
                self.counters[t] = max(self.counters[t], floor)
        self.backlogged = now_backlogged

    def order(self, waiting: list[Req], ctx: PolicyContext) -> list[Req]:
        queues: dict[str, list[Req]] = defaultdict(list)
        for r in sorted(waiting, key=lambda r: (ctx.priority_key(r), r.arrival_time)):
            queues[tenant_of(r)].append(r)
        self._lift(set(queues))
        heap = [(self.counters[t], t) for t in queues]
        heapq.heapify(heap)
        heads = dict.fromkeys(queues, 0)
        out: list[Req] = []
        while heap:
            c, t = heapq.heappop(heap)
            q = queues[t]
            r = q[heads[t]]
            heads[t] += 1
            out.append(r)
            if heads[t] < len(q):
                heapq.heappush(heap, (c + self.w_p * r.num_tokens / self.weight(t), t))
        if ctx.enable_priority:
            out.sort(key=ctx.priority_key)  # stable: vtc order within a priority class
        return out

    def on_batch(self, batch: ScheduleBatch) -> None:
        extend = batch.forward_mode.is_extend()
        for i, r in enumerate(batch.reqs):
            prefix, n = batch.prefix_lens[i], batch.extend_lens[i]
            charge = 0.0
            if extend and (prefix < r.prompt_len or n > 1):
                charge += self.w_p * n
            if prefix + n == r.num_tokens - 1 and r.output_ids:  # this step produced a token
                charge += self.w_q
            if charge:
                t = tenant_of(r)
                self.counters[t] += charge / self.weight(t)
