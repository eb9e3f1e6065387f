"""Queue-aware radix eviction (``--radix-eviction-policy queue-aware``): before each prefill round
the scheduler marks the radix nodes on the cached paths of the waiting requests as wanted
(``QueueAwareStrategy.wanted``), and eviction takes unwanted leaves first (LRU among them), the
wanted ones (LRU) only when nothing else is left. So a burst of new prompts does not evict the
prefix a queued request is about to reuse. Marking is a read-only match (``peek_prefix``) per
waiting request per round, and only with this eviction policy."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from radixserve.mem.evict_policy import QueueAwareStrategy
from radixserve.mem.radix_cache import RadixCache

if TYPE_CHECKING:
    from radixserve.sched.scheduler import Scheduler


def mark_wanted(sched: Scheduler) -> None:
    tree = sched.tree_cache
    if not isinstance(tree, RadixCache) or not isinstance(tree.strategy, QueueAwareStrategy):
        return
    wanted: set[int] = set()
    root = tree.root
    for req in sched.waiting_queue:
        ids = req.fill_ids
        ids = ids[: len(ids) - 1]
        node, pos, length = tree.peek_prefix(ids, req.extra_key)
        if length > pos:  # the match runs into a child: that child's head is wanted too
            child: Any = node.children.get(tree._child_key(node, ids[pos:], req.extra_key))
            if child is not None:
                wanted.add(child.id)
        n: Any = node
        while n is not None and n is not root and n.id not in wanted:
            wanted.add(n.id)
            n = n.parent
    tree.strategy.wanted = wanted
