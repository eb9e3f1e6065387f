"""Results of a simulated fleet: the fleet's summary, each worker's, the router's figures, tables."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from radixserve.config import ServerArgs
from radixserve.router.policy import PolicyConfig, router_policy_names
from radixserve.sim.fleet_config import FleetConfig
from radixserve.sim.fleet_state import FleetRecord, FleetTrace, branch_counts
from radixserve.sim.host_tier import tier_figures
from radixserve.sim.report import _f, class_table, fairness_line, host_tier_line, table
from radixserve.sim.simulator import SimTrace
from radixserve.sim.summary import summarize

_STAT_KEYS = ("forward_steps", "prefill_steps", "decode_steps", "prompt_tokens", "cached_tokens", "prefill_tokens",
              "generated_tokens", "num_retractions", "num_preemptions", "num_aborted", "num_finished")


def _p(values: Sequence[float], q: float) -> float | None:
    a = [v for v in values if not math.isnan(v)]
    return round(float(np.percentile(a, q)) * 1e3, 4) if a else None


def _latency(recs: Sequence[FleetRecord], duration: float) -> dict[str, Any]:
    ttft = [r.record.ttft for r in recs if not r.record.aborted]
    tpot = [r.record.tpot for r in recs if not r.record.aborted]
    prompt = sum(r.record.prompt_len for r in recs)
    return {
        "requests": len(recs),
        "ttft_ms": {"p50": _p(ttft, 50), "p95": _p(ttft, 95), "p99": _p(ttft, 99)},
        "tpot_ms": {"p50": _p(tpot, 50), "p95": _p(tpot, 95)},
        "output_tok_s": round(sum(r.record.output_len for r in recs) / duration, 3) if duration > 0 else 0.0,
        "cache_hit_rate": round(sum(r.record.cached_tokens for r in recs) / prompt, 6) if prompt else 0.0,
    }


def router_figures(recs: Sequence[FleetRecord], num_workers: int) -> dict[str, Any]:
    """What the router believed against what the engines did. ``predicted`` is the share of the
    prompt (in the key's own units, characters or tokens) the tree matched for the chosen target;
    ``actual`` the share the engine's radix cache served (``Req.cached_tokens / prompt_len``)."""
    per_worker = [0] * num_workers
    for r in recs:
        if r.worker >= 0:  # -1: refused at the router
            per_worker[r.worker] += 1
    mean = sum(per_worker) / num_workers
    d: dict[str, Any] = {
        "branches": branch_counts(recs),
        "imbalance": round(max(per_worker) / mean, 4) if mean else None,
    }
    pred = [(r.predicted, r.record) for r in recs if r.predicted is not None]
    if pred:
        prompt = sum(rec.prompt_len for _, rec in pred)
        d["predicted_hit_rate"] = round(sum(p * rec.prompt_len for p, rec in pred) / prompt, 6)
        d["actual_hit_rate"] = round(sum(rec.cached_tokens for _, rec in pred) / prompt, 6)
        d["hit_rate_error"] = round(sum(abs(p - rec.cached_tokens / rec.prompt_len) for p, rec in pred) / len(pred), 6)
    return d


def summarize_fleet(trace: FleetTrace, args: ServerArgs | None = None) -> dict[str, Any]:
    """``simulator.summarize`` of all requests together (the fleet), plus P95s, the router's
    figures, the fleet's configuration and one compact summary per worker."""
    cfg = trace.config
    engines = trace.engines
    stats = {k: sum(getattr(e.sched.stats, k) for e in engines) for k in _STAT_KEYS}
    stats["cache_hit_rate"] = stats["cached_tokens"] / stats["prompt_tokens"] if stats["prompt_tokens"] else 0.0
    merged = SimTrace(trace.label, records=[r.record for r in trace.records], step_sched_s=trace.step_sched_s,
                      step_sched_cpu_s=trace.step_sched_cpu_s, duration=trace.duration,
                      gpu_busy=sum(e.runner.busy for e in engines) / len(engines), wall_s=trace.wall_s,
                      cpu_s=trace.cpu_s, stats=stats)
    res = summarize(merged, args)
    steps = sum(e.steps for e in engines)
    res["kv_usage"] = {"mean": round(sum(e.usage_sum for e in engines) / steps, 6) if steps else 0.0,
                       "max": round(max(e.usage_max for e in engines), 6)}
    res["max_running"] = max(e.max_running for e in engines)  # on one engine
    res["max_waiting"] = max(e.max_waiting for e in engines)
    lat = _latency(trace.records, trace.duration)
    res["ttft_ms"]["p95"] = lat["ttft_ms"]["p95"]
    res["tpot_ms"]["p95"] = lat["tpot_ms"]["p95"]
    res["fleet"] = {
        "num_workers": cfg.num_workers, "dp_size": cfg.dp_size, "dp_aware": cfg.dp_aware, "policy": cfg.policy,
        "policy_config": dataclasses.asdict(cfg.policy_config), "match": cfg.match,
        "cache_events": cfg.cache_events, "cache_events_received": trace.cache_events,
        "concurrency": cfg.concurrency,
        "router_queue": None if cfg.router_max_concurrent < 0 else {
            "max_concurrent": cfg.router_max_concurrent, "queue_size": cfg.router_queue_size,
            "priority": cfg.router_priority, "tenant_fairness": cfg.router_tenant_fairness},
    }
    tier = tier_figures([e.sched.kv for e in engines])
    if tier is not None:
        res["stats"]["host_tier"] = tier
    res["router"] = router_figures(trace.records, cfg.num_workers)
    if cfg.router_replicas > 1:
        res["router"]["replicas"] = cfg.router_replicas
        res["router"]["replica_agreement"] = trace.replica_agreement
    if cfg.dp_size > 1:
        per_rank = [0] * (cfg.num_workers * cfg.dp_size)
        for r in trace.records:
            if r.worker >= 0:
                per_rank[r.worker * cfg.dp_size + r.rank] += 1
        mean = sum(per_rank) / len(per_rank)
        res["router"]["rank_imbalance"] = round(max(per_rank) / mean, 4) if mean else None
    by_worker: list[list[FleetRecord]] = [[] for _ in range(cfg.num_workers)]
    for r in trace.records:
        if r.worker >= 0:
            by_worker[r.worker].append(r)
    res["workers"] = []
    for w, recs in enumerate(by_worker):
        d = {"worker": w, **_latency(recs, trace.duration), "branches": branch_counts(recs)}
        if cfg.dp_size > 1:
            d["per_rank"] = [sum(1 for r in recs if r.rank == k) for k in range(cfg.dp_size)]
        res["workers"].append(d)
    return res


# --- text ------------------------------------------------------------------------------------------
FLEET_COLUMNS = (
    ("run", lambda r: r["label"]),
    ("workers", lambda r: f"{r['fleet']['num_workers']}x{r['fleet']['dp_size']}"
                          + (" dp-aware" if r["fleet"]["dp_aware"] and r["fleet"]["dp_size"] > 1 else "")),
    ("out tok/s", lambda r: _f(r["throughput"]["output_tok_s"], 0)),
    ("TTFT p50", lambda r: _f(r["ttft_ms"]["p50"])),
    ("TTFT p95", lambda r: _f(r["ttft_ms"]["p95"])),
    ("TTFT p99", lambda r: _f(r["ttft_ms"]["p99"])),
    ("TPOT p50", lambda r: _f(r["tpot_ms"]["p50"], 2)),
    ("TPOT p95", lambda r: _f(r["tpot_ms"]["p95"], 2)),
    ("hit rate", lambda r: _f(r["cache_hit_rate"], 3)),
    ("predicted", lambda r: _f(r["router"].get("predicted_hit_rate"), 3)),
    ("hit err", lambda r: _f(r["router"].get("hit_rate_error"), 3)),
    ("imbalance", lambda r: _f(r["router"]["imbalance"], 2)),
    ("branches", lambda r: " ".join(f"{k}:{v}" for k, v in r["router"]["branches"].items())),
)


def fleet_table(results: Sequence[dict[str, Any]]) -> str:
    """One row per run (latencies in ms of virtual time; imbalance = max / mean requests per worker)."""
    return table([[f(r) for _, f in FLEET_COLUMNS] for r in results], [h for h, _ in FLEET_COLUMNS])


def fleet_text(r: dict[str, Any], max_workers: int = 16) -> str:
    f, ro = r["fleet"], r["router"]
    lines = [
        f"== {r['label']}: {f['num_workers']} workers x {f['dp_size']} DP ranks"
        f"{' (dp-aware)' if f['dp_aware'] else ''}, router {f['policy']} matching {f['match']}"
        f"{', cache events' if f['cache_events'] else ''}"
        f"{', closed loop of ' + str(f['concurrency']) + ' clients' if f['concurrency'] else ''}",
        f"{r['completed']} completed, {r['aborted']} aborted, {r['duration_s']:.2f} s virtual (GPU busy "
        f"{r['gpu_busy_frac']:.0%} per engine), simulated in {r['wall']['sim_wall_s']:.1f} s wall",
        f"throughput {r['throughput']['output_tok_s']:.0f} output tok/s; cache hit rate {r['cache_hit_rate']:.3f}",
        f"  TTFT ms: p50 {_f(r['ttft_ms']['p50'], 2)}  p95 {_f(r['ttft_ms']['p95'], 2)}  "
        f"p99 {_f(r['ttft_ms']['p99'], 2)}",
        f"  TPOT ms: p50 {_f(r['tpot_ms']['p50'], 2)}  p95 {_f(r['tpot_ms']['p95'], 2)}",
        f"router: branches {ro['branches']}; imbalance (max/mean requests per worker) {_f(ro['imbalance'], 3)}"
        + (f", per rank {_f(ro['rank_imbalance'], 3)}" if "rank_imbalance" in ro else ""),
    ]
    if "host_tier" in r.get("stats", {}):
        lines.append(host_tier_line(r["stats"]["host_tier"]))
    if "replicas" in ro:
        lines.append(f"router replicas: {ro['replicas']}, requests each would have routed alike "
                     f"{_f(ro['replica_agreement'], 4)}")
    q = f.get("router_queue")
    if q:
        lines.append(f"router queue: at most {q['max_concurrent']} in flight, "
                     f"{'priority, ' if q['priority'] else ''}{'tenant fairness (VTC), ' if q['tenant_fairness'] else ''}"
                     f"{ro['branches'].get('router_queue_full', 0)} refused with a full queue")
    if r.get("tenant_fairness"):
        lines.append(fairness_line(r["tenant_fairness"]))
    if "goodput" in r:
        g = r["goodput"]
        lines.append(f"goodput {g['req_s']:.2f} req/s met their deadlines ({g['met']} requests, {g['fraction']:.3f} "
                     f"of all with a deadline); of the completed: TTFT met {_f(r.get('ttft_slo_attainment'), 3)}"
                     + (f", both met {_f(r.get('slo_attainment'), 3)}" if "slo_attainment" in r else ""))
    ct = class_table(r)
    if ct and len(r.get("per_class", {})) > 1:
        lines.append(ct)
    if "hit_rate_error" in ro:
        lines.append(f"router's predicted hit rate {ro['predicted_hit_rate']:.3f} vs actual {ro['actual_hit_rate']:.3f}; "
                     f"hit-rate error (mean |predicted - actual| per request) {ro['hit_rate_error']:.3f}")
    ws = r["workers"]
    if len(ws) <= max_workers:
        rows = [[str(w["worker"]), str(w["requests"]), _f(w["ttft_ms"]["p50"]), _f(w["ttft_ms"]["p95"]),
                 _f(w["ttft_ms"]["p99"]), _f(w["tpot_ms"]["p50"], 2), _f(w["tpot_ms"]["p95"], 2),
                 _f(w["output_tok_s"], 0), _f(w["cache_hit_rate"], 3),
                 " ".join(f"{k}:{v}" for k, v in w["branches"].items())] for w in ws]
        lines.append(table(rows, ["worker", "reqs", "TTFT p50", "TTFT p95", "TTFT p99", "TPOT p50", "TPOT p95",
                                  "out tok/s", "hit rate", "branches"]))
    else:
        n = np.asarray([w["requests"] for w in ws])
        hit = np.asarray([w["cache_hit_rate"] for w in ws])
        lines.append(f"per worker: requests min {n.min()} median {np.median(n):.0f} max {n.max()}; hit rate min "
                     f"{hit.min():.3f} median {np.median(hit):.3f} max {hit.max():.3f}")
    return "\n".join(lines)


# policies that read what the simulator does not model
UNSIMULATED: dict[str, str] = {}


# --- --router-policy items -------------------------------------------------------------------------
def fleet_item(base: FleetConfig, spec: str) -> tuple[str, FleetConfig]:
    """One ``--router-policy`` item: ``NAME[:field=value:...]``. NAME is a router policy; the
    overrides are fields of ``FleetConfig`` (``dp_aware=1``, ``match=chars``) or of ``PolicyConfig``
    (``balance_affinity=1``, ``cache_threshold=0.5``)."""
    name, *overrides = spec.split(":")
    if name not in router_policy_names() or name in UNSIMULATED:
        raise ValueError(f"--router-policy: {UNSIMULATED.get(name, 'unknown policy')} {name!r}; choose from "
                         f"{[n for n in router_policy_names() if n not in UNSIMULATED]}")
    fleet: dict[str, Any] = {"policy": name}
    policy: dict[str, Any] = {}
    fleet_types = {f.name: str(f.type) for f in dataclasses.fields(FleetConfig) if f.name != "policy_config"}
    policy_types = {f.name: str(f.type) for f in dataclasses.fields(PolicyConfig)}
    for ov in overrides:
        k, sep, v = ov.partition("=")
        k = k.strip().replace("-", "_")
        types = fleet_types if k in fleet_types else policy_types
        if not sep or k not in types or k == "policy":
            raise ValueError(f"--router-policy: bad override {ov!r} (want field=value, field one of "
                             f"{sorted(set(fleet_types) - {'policy'} | set(policy_types))})")
        (fleet if types is fleet_types else policy)[k] = _parse(types[k], v)
    cfg = dataclasses.replace(base, policy_config=dataclasses.replace(base.policy_config, **policy), **fleet)
    return spec, cfg


def _parse(typ: str, v: str) -> Any:
    if v.lower() == "none" and "None" in typ:
        return None
    if typ.startswith("bool"):
        return v.lower() in ("1", "true", "yes", "on")
    if typ.startswith("int"):
        return int(v)
    if typ.startswith("float"):
        return float(v)
    return v
