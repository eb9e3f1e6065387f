"""Session affinity: the requests of one session (one routing key) go to one target, so its
conversation's prefix stays in one worker's cache even where the router's tree cannot tell.

The key is the first of ``--routing-key-headers`` the request carries (e.g. ``x-session-id``),
else, with ``--routing-key-user``, the OpenAI ``user`` field. A request without one is routed by
the policy alone. Pure object, no I/O; the clock is passed in.

- **Home.** A key's target is remembered (LRU, at most ``max_keys``) until ``ttl`` seconds pass
  without a request of it. The home holds while it is eligible and not *overloaded*, by the
  policies' balance rule against the least loaded eligible target::

      home.load - min_load > balance_abs_threshold  AND  home.load > min_load * balance_rel_threshold

  Overloaded or gone, the key moves: it gets a new home (branch ``affinity_moved`` when it had one).
- **A new home** is chosen by consistent hashing with bounded loads: each target has ``VNODES``
  points on a 64-bit ring (BLAKE2b of its key), the routing key's hash walks the ring clockwise to
  the first target whose load is under ``ceil((1 + EPSILON) * (sum of loads + 1) / n)``. Routers
  that see the same targets pick the same home for a key, and a target joining or leaving moves
  only about 1/n of the keys.
- **With the policy.** ``round_robin``, ``random``, ``power_of_two``: a request with a key goes to
  its home (branch ``affinity``). ``cache_aware`` and ``deadline_aware`` still decide, with the
  home as the request's preferred target: it wins among the targets holding the longest prefix and
  takes a cache miss (branch ``affinity``); under imbalance the policy's balance rule goes first.
  Either way the chosen target becomes (or stays) the key's home.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence

from radixserve.router.policy import Decision, RouteRequest, RouterPolicy, Target

VNODES = 64  # ring points per target
EPSILON = 0.25  # bounded loads: a target may take up to 1.25x the mean before keys pass it by
MAX_KEYS = 1_000_000


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def routing_key(headers: Mapping[str, str], body: object, header_names: Sequence[str], use_user: bool) -> str | None:
    """The request's routing key (None: it has none)."""
    for name in header_names:
        value = headers.get(name)
        if value:
            return f"h:{value}"
    if use_user and isinstance(body, dict):
        user = body.get("user")
        if isinstance(user, str) and user:
            return f"u:{user}"
    return None


class SessionAffinity:
    def __init__(self, ttl: float, balance_abs_threshold: int, balance_rel_threshold: float,
                 max_keys: int = MAX_KEYS) -> None:
        self.ttl = ttl
        self.abs, self.rel = balance_abs_threshold, balance_rel_threshold
        self.max_keys = max_keys
        self.homes: OrderedDict[str, tuple[str, float]] = OrderedDict()  # key -> (target key, last seen)
        self._ring: tuple[tuple[str, ...], list[int], list[str]] = ((), [], [])

    def overloaded(self, t: Target, targets: Sequence[Target]) -> bool:
        lo = min(x.load for x in targets)
        return t.load - lo > self.abs and t.load > lo * self.rel

    def home(self, key: str, targets: Sequence[Target], now: float) -> tuple[Target, str]:
        """The key's target and why: ``affinity`` (its home), ``affinity_new`` or ``affinity_moved``."""
        got = self.homes.get(key)
        if got is not None and now - got[1] <= self.ttl:
            home = next((t for t in targets if t.key == got[0]), None)
            if home is not None and not self.overloaded(home, targets):
                return home, "affinity"
            return self.ring_choice(key, targets), "affinity_moved"
        return self.ring_choice(key, targets), "affinity_new"

    def record(self, key: str, target: Target, now: float) -> None:
        """``key``'s home is ``target`` as of ``now``; a couple of expired homes are dropped on the way
        (the map is in order of last use, so they are at its front: no sweep needed)."""
        self.homes[key] = (target.key, now)
        self.homes.move_to_end(key)
        while len(self.homes) > self.max_keys:
            self.homes.popitem(last=False)
        self.forget_expired(now, limit=2)

    def forget_expired(self, now: float, limit: int | None = None) -> int:
        """Drop the homes unused for ``ttl`` (up to ``limit``); returns how many."""
        n = 0
        while self.homes and (limit is None or n < limit):
            key, (_, seen) = next(iter(self.homes.items()))
            if now - seen <= self.ttl:
                break
            del self.homes[key]
            n += 1
        return n

    def ring_choice(self, key: str, targets: Sequence[Target]) -> Target:
        """Consistent hashing with bounded loads over ``targets`` (never empty)."""
        names = tuple(sorted(t.key for t in targets))
        if self._ring[0] != names:
            points = sorted((_hash(f"{name}#{v}"), name) for name in names for v in range(VNODES))
            self._ring = (names, [p for p, _ in points], [n for _, n in points])
        _, hashes, owners = self._ring
        by_key = {t.key: t for t in targets}
        cap = math.ceil((1 + EPSILON) * (sum(t.load for t in targets) + 1) / len(targets))
        start = bisect.bisect_left(hashes, _hash(key))
        seen: set[str] = set()
        for i in range(len(hashes)):
            owner = owners[(start + i) % len(hashes)]
            if owner in seen:
                continue
            seen.add(owner)
            if by_key[owner].load < cap:
                return by_key[owner]
            if len(seen) == len(by_key):
                break
        return min(targets, key=lambda t: t.load)  # (every target at the cap: cannot happen for cap > mean)


def decide(policy: RouterPolicy, affinity: SessionAffinity | None, targets: Sequence[Target], req: RouteRequest,
           session: str | None, now: float) -> Decision:
    """The policy's decision, with ``affinity`` for a request with a routing key (``session``): the
    router's and the simulator's one rule (module doc)."""
    if session is None or affinity is None:
        return policy.select(targets, req)
    home, branch = affinity.home(session, targets, now)
    if policy.uses_tree:  # the tree policies decide, the home preferred
        req.home = home.key
        decision = policy.select(targets, req)
    else:
        decision = Decision(home, branch)
    affinity.record(session, decision.target, now)
    return decision
