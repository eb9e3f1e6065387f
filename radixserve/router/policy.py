"""Routing policies: pure objects that pick a target for a request, registered by name.

A policy sees the eligible targets (healthy workers, or their data-parallel ranks, whose circuit
breaker lets traffic through) and the request's routing key; it returns a ``Decision``. It does no
I/O and keeps no clock, so the HTTP router and the simulator run the very same objects.

Policies (``--policy``):

- ``round_robin``: the next target in turn.
- ``random``: a uniformly random target.
- ``power_of_two``: two distinct random targets, the less loaded (ties: the first drawn). A
  target's load is the larger of the router's in-flight count and what the worker last reported.
- ``cache_aware`` (sgl-router's CacheAware): one ``PrefixTree`` records which target was sent which
  prefix. With ``loads`` the router's in-flight counts, the fleet is *imbalanced* when

      max_load - min_load > balance_abs_threshold (64)  AND  max_load > min_load * balance_rel_threshold (1.5)

  Imbalanced: the least-loaded target (branch ``balance``). Otherwise match the key against the
  tree; with ``match_rate = matched / len(key)``:
    - ``match_rate > cache_threshold`` (0.3): among the targets that match that longest prefix,
      the least loaded (branch ``cache_hit``);
    - else the target holding the smallest part of the tree (branch ``cache_miss``); with cache
      events (``miss_by_load``) the least loaded, ties to the smallest tree, since there the
      busiest worker holds the smallest real cache. With ``consistent_misses``, among the targets
      within the balance window of the least loaded (those not imbalanced against it), the one
      that ranks first for the prompt by rendezvous hashing (``blake2b(digest(key) + target)``):
      router replicas see different in-flight counts, and this rule, unlike "least loaded",
      rarely lets that change the decision; spread over many prompts it is even.
  The chosen target's path is then inserted into the tree. Ties go to the target listed first.

  With a session's preferred target (``RouteRequest.home``, affinity.py), that target wins among
  the holders of the longest match and takes a miss (branch ``affinity``).

  With cache events from workers that keep a KV tier (``--enable-hierarchical-cache``), a second
  tree follows what each worker holds in its tier: a target's match is its pool match plus
  ``tier_weight`` (0.5) times what its tier holds past that (loaded, not computed: cheaper than a
  miss, dearer than a pool hit), as Dynamo's KV router weighs lower tiers.

  ``balance_affinity`` (ours): under imbalance, instead of dropping locality altogether, the
  candidates are the targets *within the balance window* of the least loaded one (those that
  would not count as imbalanced against it), and among them the one with the longest match wins
  (branch ``balance_affinity``; with no match anywhere it is ``balance``). This keeps a long shared
  system prompt on the workers that hold it while the load spreads.

- ``deadline_aware`` (ours): ``cache_aware`` for requests without a deadline; a request with a
  time-to-first-token deadline goes where it is predicted to be met (``DeadlineAware``), or is
  refused at the router.

To add a policy: subclass ``RouterPolicy``, decorate it with ``@register_router_policy``.
"""

from __future__ import annotations

import hashlib
import random
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from radixserve.router.tree import PrefixTree


@dataclass(eq=False)
class Target:
    """One routing destination: a worker, or one data-parallel rank of a worker (``--dp-aware``).

    ``load`` is the router's own in-flight count for it; ``reported_load`` what the worker last
    said it runs or queues (``/get_load``), refreshed by the health checker."""

    url: str
    dp_rank: int | None = None
    load: int = 0
    reported_load: int = 0
    # what the worker last reported for predicting time to first token (deadline_aware), and the
    # prompt tokens the router has sent it since that report
    waiting_tokens: int = 0
    prefill_tokens_per_s: float = 0.0
    sent_tokens: int = 0
    key: str = field(init=False)

    def __post_init__(self) -> None:
        self.key = self.url if self.dp_rank is None else f"{self.url}#dp{self.dp_rank}"

    @property
    def effective_load(self) -> int:
        return max(self.load, self.reported_load)


@dataclass
class RouteRequest:
    """What a policy may look at: the prompt as text, or as token ids when the router has them."""

    text: str = ""
    tokens: Sequence[int] | None = None
    deadline_ms: float | None = None  # time-to-first-token deadline, from the request's arrival
    home: str | None = None  # the target its session prefers (affinity.py): wins ties of the tree policies

    @property
    def num_tokens(self) -> int:
        """The prompt's size in tokens (about 4 characters a token when only the text is known)."""
        return len(self.tokens) if self.tokens is not None else (len(self.text) + 3) // 4

    @property
    def key(self) -> Sequence[Any]:
        return self.tokens if self.tokens is not None else self.text


@dataclass(frozen=True)
class Decision:
    target: Target
    branch: str  # which rule chose it: cache_hit, cache_miss, balance, balance_affinity, or the policy's name
    match_rate: float = 0.0  # cache_aware: the share of the key the tree matched (for any target)
    matched: int = 0  # cache_aware: elements of the key the chosen target is believed to hold


@dataclass(frozen=True)
class PolicyConfig:
    """The knobs every policy is built from (the router's flags of the same names)."""

    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    max_tree_size: int = 2**26
    balance_affinity: bool = False
    # cache_miss by load instead of tree size: what a tree that follows the workers' real caches
    # needs (their busiest worker holds the smallest cache, and would get every new prefix)
    miss_by_load: bool = False
    # cache_miss by a hash of the prompt among the targets within the balance window: decisions that
    # do not hang on one router's own in-flight counts, so replicas of the router agree
    consistent_misses: bool = False
    tier_weight: float = 0.5  # credit for a prefix in a worker's KV tier, relative to its pool
    seed: int | None = None


class RouterPolicy:
    name: ClassVar[str] = ""
    uses_tree: ClassVar[bool] = False  # wants the prompt's key and cache events

    def __init__(self, config: PolicyConfig | None = None) -> None:
        self.config = config or PolicyConfig()
        self.rng = random.Random(self.config.seed)

    def select(self, targets: Sequence[Target], req: RouteRequest) -> Decision:
        """Pick one of ``targets`` (never empty: the caller answers 503 when nothing is eligible)."""
        raise NotImplementedError

    def remove_target(self, key: str) -> None:
        """A target left the fleet: forget what is known of it."""

    def evict(self) -> int:
        """Periodic housekeeping (``--eviction-interval-secs``); returns what was dropped."""
        return 0


_REGISTRY: dict[str, type[RouterPolicy]] = {}


def register_router_policy(cls: type[RouterPolicy]) -> type[RouterPolicy]:
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    _REGISTRY[cls.name] = cls
    return cls


def make_router_policy(name: str, config: PolicyConfig | None = None) -> RouterPolicy:
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown router policy {name!r}; choose from {router_policy_names()}") from None
    return cls(config)


def router_policy_names() -> list[str]:
    return sorted(_REGISTRY)


def key_digest(key: Sequence[Any]) -> bytes:
    """A digest of a routing key's first 1,024 elements, the same in every process (unlike
    ``hash`` of a string)."""
    head = key[:1024]
    raw = head.encode() if isinstance(head, str) else array("q", head).tobytes()
    return hashlib.blake2b(raw, digest_size=16).digest()


def least_loaded(targets: Sequence[Target]) -> Target:
    return min(targets, key=lambda t: t.load)


@register_router_policy
class RoundRobin(RouterPolicy):
    name = "round_robin"

    def __init__(self, config: PolicyConfig | None = None) -> None:
        super().__init__(config)
        self._next = 0

    def select(self, targets: Sequence[Target], req: RouteRequest) -> Decision:
        t = targets[self._next % len(targets)]
        self._next += 1
        return Decision(t, self.name)


@register_router_policy
class Random(RouterPolicy):
    name = "random"

    def select(self, targets: Sequence[Target], req: RouteRequest) -> Decision:
        return Decision(targets[self.rng.randrange(len(targets))], self.name)


@register_router_policy
class PowerOfTwo(RouterPolicy):
    name = "power_of_two"

    def select(self, targets: Sequence[Target], req: RouteRequest) -> Decision:
        if len(targets) == 1:
            return Decision(targets[0], self.name)
        i, j = self.rng.sample(range(len(targets)), 2)
        a, b = targets[i], targets[j]
        return Decision(b if b.effective_load < a.effective_load else a, self.name)


@register_router_policy
class CacheAware(RouterPolicy):
    name = "cache_aware"
    uses_tree = True

    def __init__(self, config: PolicyConfig | None = None) -> None:
        super().__init__(config)
        self.tree = PrefixTree()
        self.lower = PrefixTree()  # what the workers' KV tiers hold (cache events only)
        self._tiers_seen = False

    def imbalanced(self, max_load: int, min_load: int) -> bool:
        c = self.config
        return max_load - min_load > c.balance_abs_threshold and max_load > min_load * c.balance_rel_threshold

    def select(self, targets: Sequence[Target], req: RouteRequest) -> Decision:
        d = self.choose(targets, req)
        if req.key:
            self.tree.insert(req.key, d.target.key)
        return d

    def choose(self, targets: Sequence[Target], req: RouteRequest) -> Decision:
        """The decision ``select`` makes, without recording the chosen target's path in the tree
        (what another router replica would decide: the simulator's replica agreement)."""
        key = req.key
        loads = [t.load for t in targets]
        lo, hi = min(loads), max(loads)
        matched, per = self.tree.match(key) if key else (0, {})
        if key and self._tiers_seen and self.config.tier_weight > 0:
            matched, per = self._with_tiers(key, per)
        rate = matched / len(key) if key else 0.0
        if self.imbalanced(hi, lo):
            chosen, branch = self._rebalance(targets, lo, per)
        elif rate > self.config.cache_threshold:
            holders = [t for t in targets if per.get(t.key, 0) == matched]
            if holders:
                home = [t for t in holders if t.key == req.home]
                chosen, branch = (home or [least_loaded(holders)])[0], "cache_hit"
            else:  # the longest match belongs to no eligible target: the best eligible one
                best = max(per.get(t.key, 0) for t in targets)
                chosen = least_loaded([t for t in targets if per.get(t.key, 0) == best])
                branch = "cache_hit" if best / len(key) > self.config.cache_threshold else "cache_miss"
        elif req.home is not None and any(t.key == req.home for t in targets):
            chosen, branch = next(t for t in targets if t.key == req.home), "affinity"
        elif self.config.consistent_misses:
            window = [t for t in targets if not self.imbalanced(t.load, lo)]
            digest = key_digest(key)
            chosen = max(window, key=lambda t: hashlib.blake2b(digest + t.key.encode(), digest_size=8).digest())
            branch = "cache_miss"
        elif self.config.miss_by_load:
            chosen = min(targets, key=lambda t: (t.load, self.tree.tenant_size(t.key)))
            branch = "cache_miss"
        else:
            chosen = min(targets, key=lambda t: (self.tree.tenant_size(t.key), t.load))
            branch = "cache_miss"
        return Decision(chosen, branch, rate, int(per.get(chosen.key, 0)))

    def _with_tiers(self, key: Sequence[Any], per: dict[str, int]) -> tuple[int, dict[str, int]]:
        """Each target's match with its KV tier's part weighed in (``tier_weight`` per element past
        its pool match)."""
        _, lower = self.lower.match(key)
        if not lower:
            return max(per.values(), default=0), per
        w = self.config.tier_weight
        out = dict(per)
        for t, n in lower.items():
            pool = per.get(t, 0)
            if n > pool:
                out[t] = pool + round(w * (n - pool))
        return max(out.values(), default=0), out

    def _rebalance(self, targets: Sequence[Target], lo: int, per: dict[str, int]) -> tuple[Target, str]:
        if not self.config.balance_affinity:
            return least_loaded(targets), "balance"
        window = [t for t in targets if not self.imbalanced(t.load, lo)]
        best = max(per.get(t.key, 0) for t in window)
        if best == 0:
            return least_loaded(window), "balance"
        return least_loaded([t for t in window if per.get(t.key, 0) == best]), "balance_affinity"

    def remove_target(self, key: str) -> None:
        self.tree.remove_tenant(key)
        self.lower.remove_tenant(key)

    def evict(self) -> int:
        return self.tree.evict(self.config.max_tree_size) + self.lower.evict(self.config.max_tree_size)

    # --- the worker's real cache state (cache events) ---------------------------------------------
    def on_cache_stored(self, target_key: str, key: Sequence[Any], medium: str | None = None) -> None:
        """The worker holds ``key``: in its pool (``medium`` None) or its KV tier."""
        if medium is None:
            self.tree.insert(key, target_key)
        else:
            self._tiers_seen = True
            self.lower.insert(key, target_key)

    def on_cache_removed(self, target_key: str, key: Sequence[Any], keep: int, medium: str | None = None) -> None:
        (self.tree if medium is None else self.lower).remove(key, target_key, keep)


class NoTargetMeetsDeadline(Exception):
    """deadline_aware: no eligible target is predicted to meet the request's deadline."""

    def __init__(self, deadline_ms: float, best_ms: float) -> None:
        super().__init__(f"no worker can meet the {deadline_ms:.0f} ms time-to-first-token deadline: the best "
                         f"predicted is {best_ms:.0f} ms; retry later or with a later deadline")
        self.best_ms = best_ms


@register_router_policy
class DeadlineAware(CacheAware):
    """``cache_aware`` for requests without a deadline. A request with a time-to-first-token deadline
    goes to a target predicted to meet it,

        predicted_ttft = (waiting_tokens + sent_tokens + uncached prompt tokens) / prefill_tokens_per_s

    (what the worker last reported on ``/get_load``, plus what the router has sent it since, plus
    this prompt less the part the tree says the target holds); among those, the one holding the
    longest prefix when the match rate is above ``cache_threshold`` (branch ``deadline_hit``), else
    the one predicted fastest (``deadline_fastest``). When none is predicted to meet it, the router
    refuses the request (429) rather than let it miss its deadline at a worker. A target that has
    not reported a prefill speed yet is predicted to meet any deadline."""

    name = "deadline_aware"

    def choose(self, targets: Sequence[Target], req: RouteRequest) -> Decision:
        if req.deadline_ms is None:
            return super().choose(targets, req)
        key = req.key
        n = req.num_tokens
        matched, per = self.tree.match(key) if key else (0, {})

        def predicted_ms(t: Target) -> float:
            if t.prefill_tokens_per_s <= 0:
                return 0.0
            uncached = n * (1.0 - per.get(t.key, 0) / len(key)) if key else n
            return (t.waiting_tokens + t.sent_tokens + uncached) / t.prefill_tokens_per_s * 1e3

        preds = {t.key: predicted_ms(t) for t in targets}
        feasible = [t for t in targets if preds[t.key] <= req.deadline_ms]
        if not feasible:
            raise NoTargetMeetsDeadline(req.deadline_ms, min(preds.values()))
        best = max(per.get(t.key, 0) for t in feasible)
        if key and best / len(key) > self.config.cache_threshold:
            chosen = min((t for t in feasible if per.get(t.key, 0) == best), key=lambda t: preds[t.key])
            branch = "deadline_hit"
        else:
            chosen, branch = min(feasible, key=lambda t: preds[t.key]), "deadline_fastest"
        return Decision(chosen, branch, matched / len(key) if key else 0.0, per.get(chosen.key, 0))

