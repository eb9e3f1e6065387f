"""Tables and plots of simulation results."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from radixserve.sim.simulator import SimTrace


def _f(v: Any, digits: int = 1) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


COLUMNS = (
    ("run", lambda r: r["label"]),
    ("out tok/s", lambda r: _f(r["throughput"]["output_tok_s"], 0)),
    ("TTFT p50", lambda r: _f(r["ttft_ms"]["p50"])),
    ("TTFT p99", lambda r: _f(r["ttft_ms"]["p99"])),
    ("TPOT p50", lambda r: _f(r["tpot_ms"]["p50"], 2)),
    ("TPOT p99", lambda r: _f(r["tpot_ms"]["p99"], 2)),
    ("E2E p99", lambda r: _f(r["e2e_ms"]["p99"])),
    ("queue p99", lambda r: _f(r["queue_ms"]["p99"])),
    ("max wait s", lambda r: _f(r["max_wait_s"], 2)),
    ("hit rate", lambda r: _f(r["cache_hit_rate"], 3)),
    ("retract", lambda r: str(r["retractions"]["total"])),
    ("preempt", lambda r: str(r["preemptions"]["total"])),
    ("victim max", lambda r: str(r["victims"]["max_per_request"]) if "victims" in r else "-"),
    ("KV max", lambda r: _f(r["kv_usage"]["max"], 2)),
    ("sched ms mean", lambda r: _f(r["wall"].get("sched_ms_mean"), 3)),
    ("sched ms p99", lambda r: _f(r["wall"].get("sched_ms_p99"), 3)),
)


def table(rows: Sequence[list[str]], header: Sequence[str]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = ["| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
            + " |" for r in rows]
    return "\n".join([line, sep, *body])


# shown only when some run has the figure
OPTIONAL_COLUMNS = (
    ("goodput", "goodput req/s", lambda r: _f(r["goodput"]["req_s"], 2) if "goodput" in r else "-"),
    ("goodput", "SLO met frac", lambda r: _f(r["goodput"]["fraction"], 3) if "goodput" in r else "-"),
    ("tenant_fairness", "Jain", lambda r: _f(r["tenant_fairness"]["jain"], 3) if "tenant_fairness" in r else "-"),
)


def compare_table(results: Sequence[dict[str, Any]]) -> str:
    """One row per run (latencies in ms of virtual time; sched ms = scheduler wall time per step, forward excluded)."""
    cols = list(COLUMNS) + [(h, f) for key, h, f in OPTIONAL_COLUMNS if any(key in r for r in results)]
    return table([[f(r) for _, f in cols] for r in results], [h for h, _ in cols])


def fairness_line(tf: dict[str, Any]) -> str:
    shares = ", ".join(f"{t} {v:.3f}" for t, v in tf["share"].items())
    return (f"tenant fairness up to the last arrival ({tf['window_end_s']:.1f} s): Jain {_f(tf['jain'], 4)}; "
            f"weighted service shares {shares}")


def class_table(result: dict[str, Any]) -> str:
    rows = []
    for name, c in result.get("per_class", {}).items():
        rows.append([name, str(c["requests"]), _f(c["output_tok_s"], 0), _f(c["ttft_ms"]["p50"]), _f(c["ttft_ms"]["p90"]),
                     _f(c["ttft_ms"]["p99"]), _f(c["tpot_ms"]["p50"], 2), _f(c["tpot_ms"]["p99"], 2),
                     _f(c["e2e_ms"]["p99"]), _f(c["queue_ms"]["p99"]), _f(c["queue_ms"]["max"]), str(c["retractions"]),
                     str(c["preemptions"]),
                     _f(c.get("ttft_slo_attainment"), 3)])
    if not rows:
        return ""
    header = ["class", "reqs", "out tok/s", "TTFT p50", "TTFT p90", "TTFT p99", "TPOT p50", "TPOT p99", "E2E p99",
              "queue p99", "queue max", "retract", "preempt", "SLO met"]
    return table(rows, header)


def summary_text(r: dict[str, Any]) -> str:
    w = r["wall"]
    lines = [
        f"== {r['label']}: {r['completed']} completed, {r['aborted']} aborted, {r['duration_s']:.2f} s virtual "
        f"(GPU busy {r['gpu_busy_frac']:.0%}), simulated in {w['sim_wall_s']:.1f} s wall"
        + (f" ({w['sim_cpu_s']:.1f} s CPU)" if "sim_cpu_s" in w else ""),
        f"throughput: {r['throughput']['output_tok_s']:.0f} output tok/s, {r['throughput']['total_tok_s']:.0f} total tok/s, "
        f"{r['throughput']['req_s']:.2f} req/s; cache hit rate {r['cache_hit_rate']:.3f}",
    ]
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("e2e_ms", "E2E"), ("queue_ms", "queue")):
        p = r[key]
        lines.append(f"{name:>6} ms: p50 {_f(p['p50'], 2)}  p90 {_f(p['p90'], 2)}  p99 {_f(p['p99'], 2)}  "
                     f"max {_f(p['max'], 2)}")
    lines.append(f"max wait {r['max_wait_s']:.3f} s; retractions {r['retractions']['total']} "
                 f"({r['retractions']['per_request']:.4f}/req, max {r['retractions']['max_per_request']}); "
                 f"preemptions {r['preemptions']['total']} ({r['preemptions']['per_request']:.4f}/req)")
    if "victims" in r:
        v = r["victims"]
        lines.append(f"preempted + retracted: {v['per_request']:.4f}/req, max {v['max_per_request']} per request, "
                     f"{v['requests_hit']} requests hit")
    st = r.get("stats", {})
    if st.get("spec_verify_rows"):
        rows, drafted, kept = st["spec_verify_rows"], st["spec_draft_tokens"], st["spec_accepted_tokens"]
        lines.append(f"speculation: {st['spec_verify_steps']} verify steps, {drafted} draft tokens, {kept} accepted "
                     f"({kept / max(drafted, 1):.3f}), {(rows + kept) / rows:.2f} tokens per request and verify step")
    if "host_tier" in st:
        lines.append(host_tier_line(st["host_tier"]))
    if "ttft_slo_attainment" in r:
        lines.append(f"TTFT SLO attainment {r['ttft_slo_attainment']:.3f} (of completed requests)")
    if "tpot_slo_attainment" in r:
        lines.append(f"TPOT SLO attainment {r['tpot_slo_attainment']:.3f}, both deadlines met "
                     f"{r['slo_attainment']:.3f} (of completed requests)")
    if "goodput" in r:
        g = r["goodput"]
        what = "their deadlines" if "tpot_slo_attainment" in r else "their TTFT deadline"
        lines.append(f"goodput {g['req_s']:.2f} req/s met {what} ({g['met']} requests, "
                     f"{g['fraction']:.3f} of all with a deadline, refused ones included)")
    if r.get("tenant_fairness"):
        lines.append(fairness_line(r["tenant_fairness"]))
    if "deadline_admission" in r:
        da = r["deadline_admission"]
        e = da["estimate_tok_s"]
        lines.append(f"deadline admission: estimated prefill rate per step p5 {e['p5']:.0f}, median {e['p50']:.0f}, "
                     f"mean {e['mean']:.0f}, p95 {e['p95']:.0f}, max {e['max']:.0f} tok/s; prompt tokens prefilled "
                     f"over the run {da['served_prefill_tok_s']:.0f} tok/s")
        if "ttft_error_ms" in da:
            te = da["ttft_error_ms"]
            lines.append(f"deadline admission: TTFT actual minus predicted over {te['n']} admitted requests: mean "
                         f"{te['bias']:+.0f} ms (|error| {te['mean_abs']:.0f} ms), p5 {te['p5']:+.0f}, p95 {te['p95']:+.0f} ms")
    lines.append(f"KV usage mean {r['kv_usage']['mean']:.3f} max {r['kv_usage']['max']:.3f}; "
                 f"max running {r['max_running']}, max waiting {r['max_waiting']}")
    if w.get("steps"):
        line = (f"scheduler overhead (wall per step, forward excluded): mean {w['sched_ms_mean']:.3f} ms, "
                f"p50 {w['sched_ms_p50']:.3f}, p99 {w['sched_ms_p99']:.3f}, max {w['sched_ms_max']:.3f} "
                f"over {w['steps']} steps")
        al = w.get("at_load", {})
        if al.get("steps"):
            line += (f"; at >= {al['running>=']} running + >= {al['waiting>=']} waiting: mean "
                     f"{al['sched_ms_mean']:.3f} ms, p50 {al['sched_ms_p50']:.3f}, p99 {al['sched_ms_p99']:.3f} "
                     f"({al['steps']} steps)")
        lines.append(line)
        if "whole_step" in w:
            ws = w["whole_step"]
            how = ("overlap: the scheduler runs under the forward, max of the two" if ws["overlap"]
                   else "normal loop: forward + scheduler")
            lines.append(f"whole step ({how}): mean {ws['step_ms_mean']:.3f} ms, p99 {ws['step_ms_p99']:.3f}; "
                         f"forward alone (cost model) mean {ws['forward_ms_mean']:.3f} ms")
        if "sched_cpu_ms_mean" in w:
            line = (f"scheduler CPU (process time per step, forward excluded): mean {w['sched_cpu_ms_mean']:.3f} ms, "
                    f"p50 {w['sched_cpu_ms_p50']:.3f}, p99 {w['sched_cpu_ms_p99']:.3f}, "
                    f"max {w['sched_cpu_ms_max']:.3f}")
            if al.get("steps") and "sched_cpu_ms_mean" in al:
                line += (f"; at load: mean {al['sched_cpu_ms_mean']:.3f} ms, p50 {al['sched_cpu_ms_p50']:.3f}, "
                         f"p99 {al['sched_cpu_ms_p99']:.3f}, max {al['sched_cpu_ms_max']:.3f}")
            lines.append(line)
    ct = class_table(r)
    if ct:
        lines.append(ct)
    return "\n".join(lines)


def plot(results: Sequence[dict[str, Any]], traces: Sequence[SimTrace], path: str) -> None:
    """KV usage (and running/waiting) over virtual time, and TTFT CDFs (per class for one run,
    per run when comparing)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    for res in results:
        tl = res["kv_timeline"]
        if tl:
            ax1.plot([p[0] for p in tl], [p[1] for p in tl], label=f"{res['label']} KV usage", lw=1)
    ax1.set_xlabel("virtual time (s)")
    ax1.set_ylabel("KV usage (fraction held by running requests)")
    ax1.set_ylim(0, 1.05)
    if len(results) == 1 and results[0]["kv_timeline"]:
        tl = results[0]["kv_timeline"]
        ax1b = ax1.twinx()
        ax1b.plot([p[0] for p in tl], [p[2] for p in tl], color="tab:green", lw=0.8, label="running")
        ax1b.plot([p[0] for p in tl], [p[3] for p in tl], color="tab:red", lw=0.8, label="waiting")
        ax1b.set_ylabel("requests")
        ax1b.legend(loc="upper right", fontsize=8)
    if ax1.get_legend_handles_labels()[0]:  # a fleet's results carry no KV timeline
        ax1.legend(loc="upper left", fontsize=8)
    ax1.set_title("KV cache usage over time")

    def cdf(values: list[float], label: str) -> None:
        v = np.sort(np.asarray([x for x in values if not math.isnan(x)]) * 1e3)
        if v.size:
            ax2.plot(v, np.arange(1, v.size + 1) / v.size, label=label, lw=1.2)

    if len(traces) == 1:
        recs = traces[0].records
        groups: dict[str, list[float]] = {}
        for rec in recs:
            if rec.priority is not None:
                groups.setdefault(f"priority={rec.priority}", []).append(rec.ttft)
            if rec.tenant is not None:
                groups.setdefault(f"tenant={rec.tenant}", []).append(rec.ttft)
        cdf([r.ttft for r in recs], "all")
        for name in sorted(groups):
            cdf(groups[name], name)
    else:
        for t in traces:
            cdf([r.ttft for r in t.records], t.label)
    ax2.set_xscale("log")
    ax2.set_xlabel("TTFT (ms, virtual)")
    ax2.set_ylabel("fraction of requests")
    ax2.set_title("TTFT CDF")
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def host_tier_line(t: dict[str, Any]) -> str:
    """The host tier's work (``--enable-hierarchical-cache``) in one line."""
    return (f"host tier: {t['loads']} prefixes loaded back ({t['loaded_tokens']} tokens, {t['mean_load_ms']:.2f} ms "
            f"each on the link), {t['blocks_stored']} blocks held at the end, {t['no_room']} loads found no room")
