"""``DeadlineAdmission``: ``--deadline-admission`` and the step-time measurements it rests on.

``Req.deadline`` is an absolute TTFT deadline on the scheduler clock (``policies/edf.py``).
``--deadline-admission``: at arrival, a request with a deadline is refused (429, code
``deadline_unmeetable``) when its predicted time to first token does not fit:

    now + slot_wait + tokens_ahead / prefill_tokens_per_s > deadline

- ``tokens_ahead``: its own uncached prompt plus the tokens still to prefill of every waiting
  request at or before it in deadline order (and of the request being chunked);
- ``prefill_tokens_per_s``: starts at ``--deadline-prefill-tokens-per-s``, then an EMA (alpha 0.2)
  of the measured prefill steps (``SchedulerStats.step_log``, steps of at least 32 tokens); while
  requests wait, the slower *backlog* rate (prompt tokens prefilled per second over the last 64
  steps taken with a queue, decode steps included: the engine interleaves them to free KV and
  slots, so that is how fast a queue really drains);
- ``slot_wait``: when the running batch is full (``max_running_requests``), the requests ahead of
  it and itself need slots that only finishing requests free: the k-th shortest remaining output
  among the running requests (``max_new_tokens`` less what they have, as the reservation does)
  times the measured decode step (an EMA of decode steps). Decode steps run while the queue waits
  for slots, which is what made a prefill-only estimate optimistic under a decode-heavy load.

The prediction is kept on the request (``Req.predicted_ttft``, seconds from arrival) so the
simulator can report its error.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from radixserve.sched.finish import FINISH_ABORT
from radixserve.sched.kv_manager import KVManager
from radixserve.sched.policies.edf import deadline_of
from radixserve.sched.req import Req
from radixserve.sched.schedule_batch import ScheduleBatch
from radixserve.sched.settings import SchedSettings
from radixserve.sched.state import Queues
from radixserve.sched.stats import SchedStats

EMA_ALPHA = 0.2
BACKLOG_WINDOW = 64  # steps
MIN_SAMPLE_TOKENS = 32


class PrefillThroughput:
    """What the admission estimate needs, measured: the prefill speed of prefill steps (an EMA), the
    decode step (an EMA) and the *backlog* rate: prompt tokens prefilled per second over the last
    ``BACKLOG_WINDOW`` steps taken while requests were waiting, decode steps included. With a
    backlog the engine alternates prefill with the decode steps that free KV and slots, so a queue
    drains at the backlog rate, not at the prefill rate."""

    def __init__(self, initial: float) -> None:
        self.tokens_per_s = initial
        self.decode_step_s = 0.0  # 0 until a decode step was seen
        self._window: deque[tuple[int, float]] = deque(maxlen=BACKLOG_WINDOW)  # (prefill tokens, seconds)
        self._window_tokens = 0
        self._window_s = 0.0

    @property
    def backlog_tokens_per_s(self) -> float | None:
        """None until enough backlogged steps with some prefill were seen."""
        if len(self._window) < BACKLOG_WINDOW // 4 or self._window_tokens <= 0 or self._window_s <= 0:
            return None
        return self._window_tokens / self._window_s

    def observe(self, extend: bool, tokens: int, wall: float, backlogged: bool) -> None:
        """One forward: an extend or not, its tokens, its seconds; ``backlogged``: requests were waiting."""
        if not extend:
            if wall > 0:
                d = self.decode_step_s
                self.decode_step_s = wall if d == 0.0 else d + EMA_ALPHA * (wall - d)
        elif tokens >= MIN_SAMPLE_TOKENS and wall > 0:
            self.tokens_per_s += EMA_ALPHA * (tokens / wall - self.tokens_per_s)
        if backlogged and wall > 0:
            w = self._window
            if len(w) == w.maxlen:
                old_tokens, old_s = w[0]
                self._window_tokens -= old_tokens
                self._window_s -= old_s
            new = tokens if extend else 0
            w.append((new, wall))
            self._window_tokens += new
            self._window_s += wall


class DeadlineAdmission:
    def __init__(
        self, settings: SchedSettings, queues: Queues, kv: KVManager, stats: SchedStats, clock: Callable[[], float],
    ) -> None:
        self.settings = settings
        self.queues = queues
        self.kv = kv
        self.stats = stats
        self.clock = clock
        self.throughput = PrefillThroughput(settings.args.deadline_prefill_tokens_per_s)

    def observe(self, batch: ScheduleBatch) -> None:
        """After a forward: feed its measured time (the last ``step_log`` entry) to the estimates."""
        if self.stats.step_log:
            _, _, tokens, wall = self.stats.step_log[-1]
            self.throughput.observe(batch.forward_mode.is_extend(), tokens, wall, bool(self.queues.waiting))

    def check(self, req: Req) -> FINISH_ABORT | None:
        """At arrival: refuse ``req`` when its predicted time to first token misses its deadline."""
        d = deadline_of(req)
        if not self.settings.args.deadline_admission or d is None:
            return None
        q = self.queues
        now = self.clock()
        ahead = self.kv.uncached_tokens(req)
        queued_ahead = 0
        for r in q.waiting:
            rd = deadline_of(r)
            if rd is not None and rd <= d:
                ahead += r.num_tokens  # a waiting request's cache hit is not known until it is matched
                queued_ahead += 1
        if q.chunked is not None:
            ahead += q.chunked.num_tokens - q.chunked.num_computed_tokens
        est = self.throughput
        backlog = est.backlog_tokens_per_s if q.waiting else None
        tps = min(est.tokens_per_s, backlog) if backlog is not None else est.tokens_per_s
        wait = slot_wait(q.running.reqs, q.max_running_requests, queued_ahead + 1, est.decode_step_s)
        eta = now + wait + ahead / tps
        req.predicted_ttft = eta - now  # type: ignore[attr-defined]  # for the simulator's error report
        if eta <= d:
            return None
        self.stats.num_deadline_rejected += 1
        return FINISH_ABORT(
            f"the deadline cannot be met: {ahead} prompt tokens are ahead of this request's first token in "
            f"deadline order, about {ahead / tps * 1000:.0f} ms at {tps:.0f} prefill tokens/s, plus "
            f"{wait * 1000:.0f} ms waiting for a slot in the running batch, but only "
            f"{max(d - now, 0.0) * 1000:.0f} ms are left; retry later or with a later deadline",
            status_code=429, err_type="rate_limit_error", code="deadline_unmeetable", param="deadline_ms",
        )


def slot_wait(running: list[Req], max_running: int, slots_needed: int, decode_step_s: float) -> float:
    """Seconds until ``slots_needed`` running-batch slots are free: 0 while there are enough, else
    until enough running requests finish, the k-th shortest remaining output first."""
    free = max_running - len(running)
    k = slots_needed - free
    if k <= 0 or decode_step_s <= 0.0 or not running:
        return 0.0
    remaining = sorted(max(r.sampling_params.max_new_tokens - len(r.output_ids), 0) for r in running)
    if k > len(remaining):  # more than the whole batch must turn over: each round takes the longest
        rounds, k = divmod(k, len(remaining))
        return (rounds * remaining[-1] + (remaining[k - 1] if k else 0)) * decode_step_s
    return remaining[k - 1] * decode_step_s

