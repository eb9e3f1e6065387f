"""A simulated fleet's set-up (``FleetConfig``: workers, DP ranks, the router's policy, queue and
routing key) and the routing key itself: token ids, or ``chars_key``, a text stand-in whose length
in characters differs from its length in tokens, as sgl-router's character matching sees prompts."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

from radixserve.router.policy import PolicyConfig

ROUTER_MATCHES = ("tokens", "chars")


@dataclass(frozen=True)
class FleetConfig:
    num_workers: int = 1
    dp_size: int = 1  # data-parallel ranks (engines) per worker
    dp_aware: bool = False  # one router target per rank instead of per worker
    policy: str = "cache_aware"
    policy_config: PolicyConfig = field(default_factory=PolicyConfig)
    match: str = "tokens"  # the routing key: token ids, or a text stand-in (sgl-router matches characters)
    cache_events: bool = False  # the engines' radix cache inserts and evictions also drive the router's tree
    concurrency: int | None = None  # closed loop: this many clients, each sends its next request on an answer
    router_max_concurrent: int = -1  # the router's --max-concurrent-requests (-1: no limit, no queue)
    router_queue_size: int = 1_000_000  # the router's --queue-size
    router_priority: bool = False  # the router's --enable-priority-scheduling: its queue by priority
    router_tenant_fairness: bool = False  # the router's --tenant-fairness: its queue by VTC counters
    session_affinity: bool = False  # the router's session affinity, a conversation's id as the routing key
    # router replicas behind one address: requests reach them in turn, each routes with its own tree
    # and in-flight counts, all follow the same cache events; reports how often they would agree
    router_replicas: int = 1

    def __post_init__(self) -> None:
        if self.num_workers < 1 or self.dp_size < 1:
            raise ValueError("--num-workers and --dp-size must be at least 1")
        if self.match not in ROUTER_MATCHES:
            raise ValueError(f"--router-match: choose from {ROUTER_MATCHES}, not {self.match!r}")
        if self.router_replicas < 1:
            raise ValueError("router_replicas must be at least 1")
        if self.router_replicas > 1 and self.session_affinity:
            raise ValueError("router_replicas > 1 with session_affinity is not modelled (each replica's "
                             "sessions would be its own)")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("--concurrency must be at least 1")


# --- the routing key -------------------------------------------------------------------------------
def _word(token: int) -> str:
    """A deterministic 3-6 letter stand-in for a token's text."""
    h = (token * 0x9E3779B1 + 0x7F4A7C15) & 0xFFFFFFFF
    letters = []
    for _ in range(3 + h % 4):
        h = (h * 1103515245 + 12345) & 0x7FFFFFFF
        letters.append(chr(97 + (h >> 16) % 26))
    return "".join(letters)


@functools.cache
def _words(vocab: int = 32000) -> tuple[str, ...]:
    return tuple(_word(t) for t in range(vocab))


def chars_key(ids: Sequence[int]) -> str:
    """The prompt as sgl-router would see it: text, whose length in characters is not its length
    in tokens (each token is a word of its own length), so character match rates differ from the
    cache's token hit rates as they do for real text."""
    words = _words()
    n = len(words)
    return "".join([words[t] if 0 <= t < n else _word(t) for t in ids])
