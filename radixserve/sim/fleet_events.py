"""``--router-cache-events``: an engine's radix cache drives the simulated router's tree.

In a real fleet a worker publishes its ``RadixCache`` events (``mem.cache_events``) and the
router's subscriber applies them to the policy (``router.cache_events.apply_batch``: stored ->
``on_cache_stored``, removed -> ``on_cache_removed``, cleared -> ``remove_target``); here the
cache's ``event_sink`` makes the same calls directly, with no transport delay and no lost batches.
Unlike the router (tokens only), the simulator also maps events onto a character-keyed tree, to
compare the two keys. The fleet loop processes a step when it starts, so
the router learns of that step's inserts and evictions up to one step (milliseconds) early.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from radixserve.mem.cache_events import AllCleared, BlockRemoved, BlockStored, CacheEvent
from radixserve.router.policy import CacheAware, RouterPolicy


def event_sink(target_key: str, policy: RouterPolicy, to_key: Callable[[Sequence[int]], Sequence[Any]],
               count: Callable[[], None]) -> Callable[[CacheEvent], None] | None:
    """The sink an engine's radix cache is built with: it applies the cache's events to ``policy``
    as events of ``target_key`` (the engine's router target: its rank with --dp-aware, else its
    worker, as the router's subscriber does). ``to_key`` turns a token path into the router's key
    (token ids, or their text stand-in). None when the policy keeps no tree to drive."""
    if not isinstance(policy, CacheAware):
        return None

    def sink(ev: CacheEvent) -> None:
        count()
        if isinstance(ev, BlockStored):
            policy.on_cache_stored(target_key, to_key(ev.tokens), ev.medium)
        elif isinstance(ev, BlockRemoved):
            # the key's length in the router's units: the kept part of a text key is its own text
            keep = len(to_key(ev.tokens[: ev.keep])) if ev.keep else 0
            policy.on_cache_removed(target_key, to_key(ev.tokens), keep, ev.medium)
        elif isinstance(ev, AllCleared):
            policy.remove_target(target_key)

    return sink
