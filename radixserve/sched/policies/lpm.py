"""The cache-aware policies: ``lpm`` (longest prefix match, with in-batch prefix caching and its
incremental order, ``lpm_order.py``) and ``dfs-weight`` (``prefix_match.dfs_weight_order``)."""

from __future__ import annotations

from operator import itemgetter

from radixserve.sched.policies.base import PolicyContext, SchedulePolicy
from radixserve.sched.policies.lpm_order import IncrementalLPM
from radixserve.sched.policies.prefix_match import PrefixLengthCache, dfs_weight_order, lpm_sort_keys
from radixserve.sched.policies.simple import FCFS
from radixserve.sched.req import Req


class LongestPrefixMatch(SchedulePolicy):
    """Longest cached prefix first: requests that reuse the most KV go first. Requests that share
    an uncached prefix with one ahead of them go to the back (in-batch prefix caching). Past
    ``lpm_fallback_threshold`` waiting requests, fcfs. Matches are kept incrementally
    (``PrefixLengthCache``), so a large queue is cheap and the fallback can be turned off."""

    name = "lpm"
    cache_aware = True

    def __init__(self) -> None:
        self.matches = PrefixLengthCache()
        self.incremental = IncrementalLPM(self.matches)

    def on_admitted(self, reqs: list[Req]) -> None:
        for r in reqs:  # out of the queue: stop watching where its match stopped (it points back to r)
            if r.policy_state is not None:
                r.policy_state.match = None

    def order(self, waiting: list[Req], ctx: PolicyContext) -> list[Req]:
        tree = ctx.prefix_tree
        if tree is None or (
            ctx.lpm_fallback_threshold and len(waiting) > ctx.lpm_fallback_threshold
        ):
            self.incremental.reset()
            return FCFS().order(waiting, ctx)
        if not ctx.enable_priority:  # the same order, kept up to date between rounds (lpm_order.py)
            return self.incremental.order(waiting, tree, ctx.in_batch_check_threshold,
                                          ctx.in_batch_deprioritize_threshold)
        self.incremental.reset()  # with priorities: the class first, then the lpm key
        keys = lpm_sort_keys(waiting, tree, self.matches, ctx.in_batch_check_threshold,
                             ctx.in_batch_deprioritize_threshold)
        return [r for _, _, r in sorted(zip(map(ctx.priority_key, waiting), keys, waiting, strict=True),
                                         key=itemgetter(0, 1))]


class DFSWeight(SchedulePolicy):
    """Depth-first over the radix tree, heaviest subtree (most waiting requests) first; see
    ``prefix_match.dfs_weight_order``. No fcfs fallback, as in SGLang."""

    name = "dfs-weight"
    cache_aware = True

    def order(self, waiting: list[Req], ctx: PolicyContext) -> list[Req]:
        if ctx.prefix_tree is None:
            return FCFS().order(waiting, ctx)
        out = dfs_weight_order(waiting, ctx.prefix_tree)
        return sorted(out, key=ctx.priority_key) if ctx.enable_priority else out
