"""Result figures beyond latency percentiles: goodput, tenant fairness (Jain), victim counts.

Pure functions of the per-request records (``simulator.ReqRecord``), so they stay deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from radixserve.options import parse_tenant_weights


def jain_index(values: Sequence[float]) -> float | None:
    """``(sum x)^2 / (n * sum x^2)``: 1 when all are equal, 1/n when one gets everything."""
    sq = sum(v * v for v in values)
    if not values or sq <= 0:
        return None
    return sum(values) ** 2 / (len(values) * sq)


def _served_by(r: Any, t_end: float, w_in: float, w_out: float) -> float:
    """VTC service units of one request done by ``t_end``: its computed prompt when its first token
    came out, then its output tokens at the request's mean pace (first token to finish)."""
    if math.isnan(r.ttft):
        return 0.0
    first = r.arrival + r.ttft
    if first > t_end:
        return 0.0
    fin = r.arrival + r.e2e
    n = r.output_len
    if fin <= t_end or n <= 1:
        out = n
    else:
        out = 1 + int((n - 1) * (t_end - first) / (fin - first))
    return w_in * (r.prompt_len - r.cached_tokens) + w_out * out


def tenant_fairness(records: Sequence[Any], args: Any = None) -> dict[str, Any] | None:
    """Jain index of the tenants' weighted service (VTC units: ``w_p`` x computed prompt tokens +
    ``w_q`` x output tokens, divided by ``--tenant-weights``), counted up to the last arrival: after
    it the queue only drains, and a drained run has served every tenant all it asked for."""
    tenants = sorted({r.tenant for r in records if r.tenant is not None})
    if len(tenants) < 2:
        return None
    weights = parse_tenant_weights(getattr(args, "tenant_weights", None))
    w_in = float(getattr(args, "vtc_input_weight", 1.0))
    w_out = float(getattr(args, "vtc_output_weight", 2.0))
    t_end = max(r.arrival for r in records)
    served = {t: 0.0 for t in tenants}
    for r in records:
        if r.tenant is not None and not r.aborted:
            served[r.tenant] += _served_by(r, t_end, w_in, w_out)
    norm = [served[t] / weights.get(t, 1.0) for t in tenants]
    total = sum(norm)
    j = jain_index(norm)
    return {"window_end_s": round(t_end, 6), "jain": None if j is None else round(j, 4),
            "share": {t: round(v / total, 4) if total > 0 else 0.0 for t, v in zip(tenants, norm, strict=True)}}


def tpot_met(r: Any) -> bool:
    """A one-token output has no time per output token: it meets any TPOT deadline."""
    return r.tpot_deadline is None or math.isnan(r.tpot) or r.tpot <= r.tpot_deadline


def slo_met(r: Any) -> bool:
    """Not aborted, the first token by its TTFT deadline and its tokens within its TPOT deadline."""
    ttft_ok = r.deadline is None or (not math.isnan(r.ttft) and r.ttft <= r.deadline)
    return not r.aborted and ttft_ok and tpot_met(r)


def goodput(records: Sequence[Any], duration: float) -> dict[str, Any] | None:
    """Requests that met their deadlines (TTFT, and TPOT where they have one), per second and as a
    fraction of *all* requests with a deadline (refused and aborted ones count as missed)."""
    with_dl = [r for r in records if r.deadline is not None or getattr(r, "tpot_deadline", None) is not None]
    if not with_dl:
        return None
    met = sum(map(slo_met, with_dl))
    return {"met": met, "req_s": round(met / duration, 4) if duration > 0 else 0.0,
            "fraction": round(met / len(with_dl), 4)}


def victim_counts(records: Sequence[Any]) -> dict[str, Any]:
    """Preemptions + retractions per request (what ``--max-preemptions-per-request`` caps)."""
    per = [r.retractions + r.preemptions for r in records]
    return {"per_request": round(sum(per) / max(len(per), 1), 6), "max_per_request": max(per, default=0),
            "requests_hit": sum(1 for v in per if v > 0)}
