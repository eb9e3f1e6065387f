"""Backpressure at the router: at most ``--max-concurrent-requests`` in flight, a bounded FIFO of
waiters behind them (``--queue-size``, each waiting at most ``--queue-timeout-secs``), and a 429
for everything past that. A released slot is handed straight to the oldest waiter, so a waiter
can never be overtaken by a newcomer.
"""

from __future__ import annotations

import asyncio
from collections import deque


class Admission:
    def __init__(self, limit: int, queue_size: int, timeout_s: float) -> None:
        self.limit = limit  # -1: no limit
        self.queue_size = queue_size
        self.timeout_s = timeout_s
        self.in_flight = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self.rejected = 0
        self.timed_out = 0

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> bool:
        """Take a slot, waiting in the queue if need be; False means answer 429."""
        if self.limit < 0 or (self.in_flight < self.limit and not self._waiters):
            self.in_flight += 1
            return True
        if len(self._waiters) >= self.queue_size:
            self.rejected += 1
            return False
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.timeout_s)
            return True
        except asyncio.TimeoutError:
            if fut.done():  # the slot arrived as the timer fired: keep it
                return True
            self.timed_out += 1
            return False
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # got a slot but the client left: pass it on
                self.release()
            raise
        finally:
            if not fut.done():
                fut.cancel()
                try:
                    self._waiters.remove(fut)
                except ValueError:
                    pass

    def release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot moves to the waiter; in_flight is unchanged
                return
        self.in_flight -= 1
