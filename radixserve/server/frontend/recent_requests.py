"""The HTTP process's side of the live dashboard: TTFT and TPOT of the last ``RECENT_REQUESTS``
finished requests, kept as their last output passes through (``RecentRequests``), so the
scheduler does nothing for them. ``GET /dashboard/state`` adds them to every rank's
``scheduler/dashboard_state.rank_snapshot`` (docs/dashboard.md).
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixserve.sched.io import OutRow
    from radixserve.server.frontend.req_state import ReqState

RECENT_REQUESTS = 100  # finished requests whose TTFT / TPOT the page plots


class RecentRequests:
    """TTFT and TPOT of the last ``size`` finished requests (aborted ones are counted, not kept)."""

    def __init__(self, size: int = RECENT_REQUESTS) -> None:
        self.rows: deque[tuple[float, float, float | None, int, int]] = deque(maxlen=size)
        self.aborted = 0

    def add(self, st: ReqState, last: OutRow, now: float) -> None:
        """``st`` finished with ``last`` at ``now`` (perf_counter, as ``st.created``)."""
        if (last.finished_reason is not None and last.finished_reason.is_abort) or st.ttft is None:
            self.aborted += 1
            return
        n = last.completion_tokens
        tpot = (now - st.created - st.ttft) / (n - 1) if n > 1 else None
        self.rows.append((time.time(), st.ttft, tpot, last.prompt_tokens, n))

    def summary(self) -> dict[str, Any]:
        rows = list(self.rows)
        ttfts = [r[1] for r in rows]
        tpots = [r[2] for r in rows if r[2] is not None]
        return {"aborted": self.aborted, "count": len(rows),
                "ttft": percentiles(ttfts), "tpot": percentiles(tpots),
                # oldest first: [finished at (unix s), ttft s, tpot s or null, prompt tokens, output tokens]
                "recent": [list(r) for r in rows]}


def percentiles(xs: list[float]) -> dict[str, float | None]:
    """p50 / p90 / p99 / max by the nearest rank (None when empty)."""
    if not xs:
        return {"p50": None, "p90": None, "p99": None, "max": None}
    s = sorted(xs)

    def rank(p: float) -> float:
        return s[max(0, math.ceil(len(s) * p / 100) - 1)]

    return {"p50": rank(50), "p90": rank(90), "p99": rank(99), "max": s[-1]}
