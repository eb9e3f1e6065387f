"""``DeadlineAdmission``: ``--deadline-admission`` and the step-time measurements it rests on.

``Req.deadline`` is an absolute TTFT deadline on the scheduler clock (``policies/edf.py``).
``--deadline-admission``: at arrival, a request with a deadline is refused (429, code
``deadline_unmeetable``) when its predicted time to first token does not fit:

    now + slot_wait + tokens_ahead / prefill_tokens_per_s > deadline

- ``tokens_ahead``: its own uncached prompt plus the tokens still to prefill of every waiting
  request at or before it in deadline order (and of the request being chunked);
- ``prefill_tokens_per_s``: starts at ``--deadline-prefill-tokens-per-s``, then an EMA (alpha 0.2)
  of the measured prefill steps (``SchedStats.step_log``, steps of at least 32 tokens); while
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

TPOT deadlines (``Req.tpot_slo``, seconds per output token; ``x-slo-tpot-ms`` / ``tpot_slo_ms``):
the decode step's time is modelled from the measured decode steps as ``a + c * batch`` (least
squares over the last 64, ``DecodeStepModel``). With ``T`` the tightest TPOT deadline among the
running requests times ``--tpot-headroom``:
- the running batch is capped at the largest batch whose modelled step fits ``T`` (``batch_cap``;
  the one being admitted counts with its own deadline);
- prefill steps, which stall every running request, are paced (``may_prefill``): each one's time
  is a debt that the decode steps after it pay off by ``T`` minus their own time, and the next
  prefill waits until the debt is paid. So the time a running request spends per output token,
  decode and interleaved prefills together, stays near ``T``;
- a request whose own TPOT cannot be met even alone is refused at arrival (429,
  ``tpot_unmeetable``), and the TTFT estimate's ``slot_wait`` uses the capped batch (the pacing
  shows in the measured backlog rate).
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


def tpot_of(req: Req) -> float | None:
    return req.tpot_slo


class DecodeStepModel:
    """``step_s = a + c * batch`` fitted by least squares to the last ``BACKLOG_WINDOW`` decode steps;
    a constant (the mean) until two batch sizes were seen."""

    def __init__(self) -> None:
        self._steps: deque[tuple[int, float]] = deque(maxlen=BACKLOG_WINDOW)
        self._fit: tuple[float, float] | None = None  # the last fit, until the next decode step

    def observe(self, batch_size: int, step_s: float) -> None:
        if batch_size > 0 and step_s > 0:
            self._steps.append((batch_size, step_s))
            self._fit = None

    def coefficients(self) -> tuple[float, float] | None:
        """``(a, c)``, or None before any decode step. Fitted once per decode step, however many
        admissions read it in between."""
        if self._fit is None and self._steps:
            self._fit = self._least_squares()
        return self._fit

    def _least_squares(self) -> tuple[float, float]:
        pts = self._steps
        n = len(pts)
        mx = sum(b for b, _ in pts) / n
        my = sum(t for _, t in pts) / n
        var = sum((b - mx) ** 2 for b, _ in pts)
        if var <= 0:
            return my, 0.0
        c = max(sum((b - mx) * (t - my) for b, t in pts) / var, 0.0)
        return max(my - c * mx, 0.0), c

    def max_batch(self, step_budget_s: float) -> int | None:
        """The largest batch whose modelled step fits ``step_budget_s`` (0: not even one request);
        None while nothing is measured or the step does not grow with the batch."""
        ac = self.coefficients()
        if ac is None:
            return None
        a, c = ac
        if a > step_budget_s:
            return 0
        if c <= 0:
            return None
        return int((step_budget_s - a) / c + 1e-9)  # (a budget that fits exactly, despite rounding)


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
        self.decode_model = DecodeStepModel()
        self.tpot_tight: float | None = None  # the running requests' tightest TPOT deadline (s), set each round
        self.tpot_in_use = False  # a request with a TPOT deadline was seen: until then the rules cost nothing
        self.prefill_debt_s = 0.0

    def observe(self, batch: ScheduleBatch) -> None:
        """After a forward: feed its measured time (the last ``step_log`` entry) to the estimates."""
        if self.stats.step_log:
            _, bs, tokens, wall = self.stats.step_log[-1]
            extend = batch.forward_mode.is_extend()
            self.throughput.observe(extend, tokens, wall, bool(self.queues.waiting))
            if not extend:
                self.decode_model.observe(bs, wall)
            tight = self.tpot_tight
            if tight is None:
                self.prefill_debt_s = 0.0
            elif extend:
                self.prefill_debt_s += wall
            else:
                self.prefill_debt_s = max(self.prefill_debt_s - max(tight * self.settings.args.tpot_headroom - wall, 0.0),
                                          0.0)

    def may_prefill(self, tight: float | None) -> bool:
        """Whether a prefill step may stall the running requests now (their tightest TPOT deadline
        ``tight``): always without one, else once the earlier prefills' debt is paid."""
        self.tpot_tight = tight
        return tight is None or self.prefill_debt_s <= 0.0

    @staticmethod
    def tightest(reqs: list[Req], tight: float | None = None) -> float | None:
        """The smallest TPOT deadline among ``reqs`` (and ``tight``), None if none has one."""
        for t in map(tpot_of, reqs):
            if t is not None and (tight is None or t < tight):
                tight = t
        return tight

    def batch_cap(self, tight: float | None) -> int | None:
        """The most requests that may run so a TPOT deadline of ``tight`` seconds holds; None when
        there is no deadline or nothing is measured yet."""
        if tight is None:
            return None
        return self.decode_model.max_batch(tight * self.settings.args.tpot_headroom)

    def check(self, req: Req) -> FINISH_ABORT | None:
        """At arrival: refuse ``req`` when its TPOT deadline cannot be met even alone, or its
        predicted time to first token misses its TTFT deadline."""
        tpot = tpot_of(req)
        if tpot is not None:
            self.tpot_in_use = True
        if not self.settings.args.deadline_admission:
            return None
        if tpot is not None and self.decode_model.max_batch(tpot * self.settings.args.tpot_headroom) == 0:
            self.stats.num_deadline_rejected += 1
            a, _ = self.decode_model.coefficients() or (0.0, 0.0)
            return FINISH_ABORT(
                f"the TPOT deadline cannot be met: a decode step takes at least {a * 1000:.0f} ms here, over "
                f"{self.settings.args.tpot_headroom:g} x the {tpot * 1000:.0f} ms asked for; retry with a longer "
                "tpot_slo_ms", status_code=429, err_type="rate_limit_error", code="tpot_unmeetable",
                param="tpot_slo_ms",
            )
        d = deadline_of(req)
        if d is None:
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
        cap = self.batch_cap(self.tightest(q.running.reqs, tpot_of(req)))
        slots = q.max_running_requests if cap is None else max(min(cap, q.max_running_requests), 1)
        wait = slot_wait(q.running.reqs, slots, queued_ahead + 1, est.decode_step_s)
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

