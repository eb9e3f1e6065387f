"""A worker's life at the router beyond its health checks: stalled, wedged, warming up. Pure (the
clock and the random draws are passed in); ``Fleet`` feeds it and asks it per request.

- **Stalled** (``--worker-stall-secs S``): no contact for S seconds (a health check passed, a
  ``/get_load`` read, an answer to a request): no new traffic until contact resumes.
- **Wedged** (``--worker-wedge-secs W``): the router has requests in flight on it, and its engine
  ran no step for W seconds (``/get_load``'s ``forward_steps``, read every second while this is
  on): no new traffic. Its requests in flight are left alone (they may still finish); it is back as
  soon as its steps move again, or once nothing of ours is in flight on it.
- **Warming up** (``--worker-warmup-secs U``): a worker that joins, or comes back after being out
  of rotation, gets a growing share: for U seconds a request may go to it with probability
  ``elapsed / U`` (it is left out of that request's choice otherwise), so a cold cache is not handed
  a full share at once. The workers the router starts with are warm.

A worker left out this way still gets requests when leaving it out would leave none: the fleet
serves as long as its health checks pass.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class WorkerLife:
    joined: float  # when it (re)joined rotation
    last_contact: float
    steps: int | None = None  # the last forward_steps it reported (summed over its ranks)
    steps_moved: float = 0.0  # when they last changed, or our in-flight count was last 0


class Lifecycle:
    def __init__(self, stall_secs: float | None = None, wedge_secs: float | None = None, warmup_secs: float = 0.0,
                 seed: int | None = None) -> None:
        self.stall, self.wedge, self.warmup = stall_secs, wedge_secs, warmup_secs
        self.rng = random.Random(seed)
        self.lives: dict[str, WorkerLife] = {}

    @property
    def watches_steps(self) -> bool:
        return self.wedge is not None

    def _life(self, url: str, now: float) -> WorkerLife:
        life = self.lives.get(url)
        if life is None:  # first seen (a worker of the router's start): warm already
            life = self.lives[url] = WorkerLife(joined=now - self.warmup, last_contact=now, steps_moved=now)
        return life

    def joined(self, url: str, now: float) -> None:
        """``url`` joins rotation, or is back in it (its warm-up starts over)."""
        life = self._life(url, now)
        life.joined = life.last_contact = life.steps_moved = now

    def left(self, url: str) -> None:
        self.lives.pop(url, None)

    def contact(self, url: str, now: float) -> None:
        self._life(url, now).last_contact = now

    def steps(self, url: str, steps: int, now: float) -> None:
        life = self._life(url, now)
        life.last_contact = now
        if steps != life.steps:
            life.steps, life.steps_moved = steps, now

    def state(self, url: str, in_flight: int, now: float) -> str:
        """``ok``, ``stalled``, ``wedged`` or ``warming``."""
        life = self._life(url, now)
        if self.stall is not None and now - life.last_contact > self.stall:
            return "stalled"
        if self.wedge is not None:
            if in_flight == 0:
                life.steps_moved = now
            elif now - life.steps_moved > self.wedge:
                return "wedged"
        if self.warmup > 0 and now - life.joined < self.warmup:
            return "warming"
        return "ok"

    def admits(self, url: str, in_flight: int, now: float) -> bool:
        """May a new request go to ``url`` now (a warming worker: by its share, drawn)."""
        st = self.state(url, in_flight, now)
        if st == "warming":
            return self.rng.random() < (now - self.lives[url].joined) / self.warmup
        return st == "ok"
