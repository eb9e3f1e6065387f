"""What a simulation run measured, summarized: latency percentiles (TTFT, TPOT, end to end),
throughput, cache hits, preemption counts, per-class figures and the scheduler's own wall and CPU
time per step (``wall_summary``: at the running / waiting sizes that matter)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from radixserve.config import ServerArgs
from radixserve.sim import metrics
from radixserve.sim.simulator import ReqRecord, SimTrace


def _pct(values: Sequence[float], scale: float = 1e3) -> dict[str, float | None]:
    a = np.asarray([v for v in values if not math.isnan(v)], dtype=float)
    if a.size == 0:
        return {"mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"mean": round(float(a.mean()) * scale, 4), "p50": round(float(p50) * scale, 4),
            "p90": round(float(p90) * scale, 4), "p99": round(float(p99) * scale, 4),
            "max": round(float(a.max()) * scale, 4)}


def _latency(records: Sequence[ReqRecord], duration: float) -> dict[str, Any]:
    done = [r for r in records if not r.aborted]
    out_tokens = sum(r.output_len for r in done)
    d: dict[str, Any] = {
        "requests": len(records),
        "aborted": len(records) - len(done),
        "output_tok_s": round(out_tokens / duration, 3) if duration > 0 else 0.0,
        "ttft_ms": _pct([r.ttft for r in done]),
        "tpot_ms": _pct([r.tpot for r in done]),
        "e2e_ms": _pct([r.e2e for r in done]),
        "queue_ms": _pct([r.queue for r in records]),
        "retractions": sum(r.retractions for r in records),
        "preemptions": sum(r.preemptions for r in records),
    }
    with_dl = [r for r in done if r.deadline is not None]
    if with_dl:
        met = sum(1 for r in with_dl if r.deadline is not None and not math.isnan(r.ttft) and r.ttft <= r.deadline)
        d["ttft_slo_attainment"] = round(met / len(with_dl), 4)
    with_tpot = [r for r in done if r.tpot_deadline is not None]
    if with_tpot:
        d["tpot_slo_attainment"] = round(sum(map(metrics.tpot_met, with_tpot)) / len(with_tpot), 4)
        both = [r for r in done if r.deadline is not None or r.tpot_deadline is not None]
        d["slo_attainment"] = round(sum(map(metrics.slo_met, both)) / len(both), 4)
    return d


def summarize(trace: SimTrace, args: ServerArgs | None = None) -> dict[str, Any]:
    """The result dict of one run. Everything outside ``"wall"`` is a pure function of the inputs
    (seeded workload, options): two runs with the same seed give equal dicts but for ``"wall"``.
    ``args`` gives the tenant and VTC weights of the fairness figure (default: all 1, VTC's 1 and 2)."""
    recs = trace.records
    done = [r for r in recs if not r.aborted]
    dur = trace.duration
    prompt = sum(r.prompt_len for r in done)
    out_tok = sum(r.output_len for r in done)
    n = max(len(recs), 1)
    res: dict[str, Any] = {
        "label": trace.label,
        "num_requests": len(recs),
        "completed": len(done),
        "aborted": len(recs) - len(done),
        "duration_s": round(dur, 6),
        "gpu_busy_frac": round(trace.gpu_busy / dur, 4) if dur > 0 else 0.0,
        "throughput": {
            "output_tok_s": round(out_tok / dur, 3) if dur > 0 else 0.0,
            "total_tok_s": round((out_tok + prompt) / dur, 3) if dur > 0 else 0.0,
            "req_s": round(len(done) / dur, 4) if dur > 0 else 0.0,
        },
        "cache_hit_rate": round(trace.stats.get("cache_hit_rate", 0.0), 6),
        "retractions": {"total": trace.stats.get("num_retractions", 0),
                        "per_request": round(sum(r.retractions for r in recs) / n, 6),
                        "max_per_request": max((r.retractions for r in recs), default=0)},
        "preemptions": {"total": trace.stats.get("num_preemptions", 0),
                        "per_request": round(sum(r.preemptions for r in recs) / n, 6),
                        "max_per_request": max((r.preemptions for r in recs), default=0)},
        "max_wait_s": round(max((r.queue for r in recs if not math.isnan(r.queue)), default=0.0), 6),
        "stats": trace.stats,
    }
    if trace.truncated:
        res["truncated_at_steps"] = len(trace.step_sched_s)
    res.update({k: v for k, v in _latency(recs, dur).items() if k.endswith("_ms") or k.endswith("slo_attainment")})
    usage = [u for _, u, _, _ in trace.timeline]
    res["kv_usage"] = {"mean": round(float(np.mean(usage)), 6) if usage else 0.0,
                       "max": round(float(np.max(usage)), 6) if usage else 0.0}
    res["max_running"] = max((r for _, _, r, _ in trace.timeline), default=0)
    res["max_waiting"] = max((w for _, _, _, w in trace.timeline), default=0)
    classes: dict[str, Any] = {}
    for key, attr in (("priority", "priority"), ("tenant", "tenant")):
        values = sorted({getattr(r, attr) for r in recs if getattr(r, attr) is not None}, key=str)
        for v in values:
            classes[f"{key}={v}"] = _latency([r for r in recs if getattr(r, attr) == v], dur)
    if classes:
        res["per_class"] = classes
    res["victims"] = metrics.victim_counts(recs)
    for key, val in (("goodput", metrics.goodput(recs, dur)), ("tenant_fairness", metrics.tenant_fairness(recs, args))):
        if val is not None:
            res[key] = val
    if trace.prefill_estimate and dur > 0:  # what --deadline-admission believed, against what was served
        est = np.asarray(trace.prefill_estimate, dtype=float)
        res["deadline_admission"] = {
            "estimate_tok_s": {"p5": round(float(np.percentile(est, 5)), 1),
                               "p50": round(float(np.percentile(est, 50)), 1),
                               "mean": round(float(est.mean()), 1),
                               "p95": round(float(np.percentile(est, 95)), 1),
                               "max": round(float(est.max()), 1)},
            "served_prefill_tok_s": round(trace.stats.get("prefill_tokens", 0) / dur, 1),
        }
        # the TTFT predicted at admission against the TTFT the admitted requests got
        pairs = [(r.predicted_ttft, r.ttft) for r in recs
                 if r.predicted_ttft is not None and not r.aborted and not math.isnan(r.ttft)]
        if pairs:
            err = np.asarray([a - p for p, a in pairs], dtype=float) * 1e3
            res["deadline_admission"]["ttft_error_ms"] = {
                "n": len(pairs), "mean_abs": round(float(np.abs(err).mean()), 1), "bias": round(float(err.mean()), 1),
                "p5": round(float(np.percentile(err, 5)), 1), "p95": round(float(np.percentile(err, 95)), 1)}
    res["kv_timeline"] = [[round(t, 6), round(u, 6), r, w] for t, u, r, w in trace.timeline]
    res["wall"] = wall_summary(trace)
    return res


def wall_summary(trace: SimTrace, at_running: int = 1024, at_waiting: int = 8192) -> dict[str, Any]:
    """The scheduler's time per step, forward excluded, as wall time (``sched_ms_*``) and as process
    CPU time (``sched_cpu_ms_*``, steadier on a shared machine): every step, and the steps at
    >= ``at_running`` running (or all slots full) with >= ``at_waiting`` waiting (``at_load``)."""
    s = np.asarray(trace.step_sched_s, dtype=float) * 1e3
    c = np.asarray(trace.step_sched_cpu_s, dtype=float) * 1e3
    d: dict[str, Any] = {"sim_wall_s": round(trace.wall_s, 3), "sim_cpu_s": round(trace.cpu_s, 3), "steps": int(s.size)}
    f = np.asarray(trace.step_forward_s, dtype=float) * 1e3
    if s.size and f.size == s.size:  # the whole step: forward and scheduler, or the longer of the two
        whole = np.maximum(f, s) if trace.overlap else f + s
        d["whole_step"] = {"overlap": trace.overlap, "forward_ms_mean": round(float(f.mean()), 4),
                           "step_ms_mean": round(float(whole.mean()), 4),
                           "step_ms_p99": round(float(np.percentile(whole, 99)), 4)}
    if s.size:
        for name, v in (("sched_ms", s), ("sched_cpu_ms", c)):
            if v.size == s.size:
                d.update(_ms_stats(name, v))
        run_ = np.asarray(trace.step_running)
        wait = np.asarray(trace.step_waiting)
        full = run_ >= min(at_running, int(run_.max()) if run_.size else 0)
        mask = full & (wait >= at_waiting)
        d["at_load"] = {"running>=": at_running, "waiting>=": at_waiting, "steps": int(mask.sum())}
        if mask.any():
            for name, v in (("sched_ms", s), ("sched_cpu_ms", c)):
                if v.size == s.size:
                    d["at_load"].update(_ms_stats(name, v[mask]))
    return d


def _ms_stats(name: str, v: np.ndarray) -> dict[str, float]:
    return {f"{name}_mean": round(float(v.mean()), 4), f"{name}_p50": round(float(np.percentile(v, 50)), 4),
            f"{name}_p99": round(float(np.percentile(v, 99)), 4), f"{name}_max": round(float(v.max()), 4)}
