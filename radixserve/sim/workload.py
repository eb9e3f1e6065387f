"""Simulated workloads: request specs (arrival, lengths, class), their token ids, JSONL traces.

A ``RequestSpec`` is small (no token list), so 100,000 of them cost little; the prompt's token ids
are made when the request arrives (``prompt_ids``) from deterministic token *streams*:

- ``stream_tokens(key, start, stop)`` is a fixed pseudo-random sequence per key.
- A request's prompt is ``prefix stream of its prefix_group [:prefix_len]`` + its own stream
  ``[:prompt_len - prefix_len]``, and the simulated runner emits its own stream's *next* tokens as
  output. So turn t+1 of a conversation (same stream, longer prompt) contains turn t's prompt and
  simulated answer exactly, and the radix cache sees the hits a real multi-turn chat gives.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

VOCAB_LOW, VOCAB_HIGH = 200, 32000  # ordinary (non-special) ids of a Llama-2 vocabulary
EOS_TOKEN_ID = 2  # Llama-2's </s>; never produced by a stream
_M64 = (1 << 64) - 1
_A, _B, _C = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_PREFIX_KEY_BASE = 1 << 40


def stream_token(key: int, i: int) -> int:
    """Token ``i`` of stream ``key`` (the scalar twin of ``stream_tokens``)."""
    x = ((key * _A) + (i + 1) * _B) & _M64
    x = ((x ^ (x >> 31)) * _C) & _M64
    return VOCAB_LOW + (x >> 11) % (VOCAB_HIGH - VOCAB_LOW)


def stream_tokens(key: int, start: int, stop: int) -> list[int]:
    if stop <= start:
        return []
    i = np.arange(start + 1, stop + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = np.uint64((key * _A) & _M64) + i * np.uint64(_B)
        x = (x ^ (x >> np.uint64(31))) * np.uint64(_C)
    return (np.uint64(VOCAB_LOW) + (x >> np.uint64(11)) % np.uint64(VOCAB_HIGH - VOCAB_LOW)).tolist()


@dataclass
class RequestSpec:
    rid: str
    arrival_time: float  # seconds of virtual time
    prompt_len: int
    output_len: int  # the sampled output length: the runner emits EOS as token output_len
    priority: int | None = None
    tenant: str | None = None
    deadline_ms: float | None = None  # TTFT deadline relative to arrival
    tpot_slo_ms: float | None = None  # TPOT deadline: mean ms per output token after the first
    prefix_group: int | None = None
    prefix_len: int = 0  # tokens of the group's shared prefix at the start of the prompt
    stream: int = 0  # key of this request's own token stream (a conversation's turns share one)
    conversation: int | None = None
    turn: int = 0
    input_ids: list[int] | None = None  # explicit prompt (traces); overrides the streams

    def prompt_ids(self) -> list[int]:
        if self.input_ids is not None:
            return list(self.input_ids)
        own = stream_tokens(self.stream, 0, self.prompt_len - self.prefix_len)
        if self.prefix_group is None or self.prefix_len <= 0:
            return own
        return stream_tokens(_PREFIX_KEY_BASE + self.prefix_group, 0, self.prefix_len) + own

    @property
    def stream_offset(self) -> int:
        """Index in ``stream`` of the first output token."""
        return self.prompt_len - self.prefix_len


@dataclass
class WorkloadConfig:
    num_requests: int = 1000
    workload: str = "random"  # random | shared-prefix | multi-turn
    request_rate: float = 10.0  # requests/s; inf: all at t=0
    arrival: str = "poisson"  # poisson | bursty
    burstiness: float = 4.0  # bursty: coefficient of variation of the gamma inter-arrival times
    input_len: int = 512
    output_len: int = 128
    len_dist: str = "uniform"  # fixed | uniform | exponential
    range_ratio: float = 0.5  # uniform: lengths in [len x (1-r), len x (1+r)]
    num_prefix_groups: int = 8
    prefix_len: int | None = None  # None: 1024 for shared-prefix, 0 (no system prompt) for multi-turn
    num_turns: int = 4
    turn_len: int = 64  # new user tokens per turn
    think_time: float = 5.0  # mean seconds between a conversation's turns
    priority_classes: str | None = None  # "0:0.8,10:0.2"
    tenants: str | None = None  # "a:10,b:1"
    ttft_slo_ms: float | None = None
    ttft_slo_classes: str | None = None  # "300:0.5,3000:0.5": TTFT deadline ms:fraction
    tpot_slo_ms: float | None = None
    context_len: int = 4096
    seed: int = 0


def parse_weights(text: str | None, what: str) -> list[tuple[str, float]]:
    """``"a:10,b:1"`` -> [("a", 10.0), ("b", 1.0)]."""
    if not text:
        return []
    out = []
    for part in text.split(","):
        name, sep, w = part.strip().rpartition(":")
        if not sep or not name:
            raise ValueError(f"{what}: expected name:weight pairs like 'a:10,b:1', got {part!r}")
        weight = float(w)
        if weight < 0:
            raise ValueError(f"{what}: weight of {name!r} must be >= 0")
        out.append((name, weight))
    if sum(w for _, w in out) <= 0:
        raise ValueError(f"{what}: weights must not all be zero")
    return out


def _length(rng: random.Random, mean: int, dist: str, ratio: float) -> int:
    if dist == "fixed":
        return max(mean, 1)
    if dist == "uniform":
        lo, hi = max(int(mean * (1 - ratio)), 1), max(int(mean * (1 + ratio)), 1)
        return rng.randint(lo, hi)
    if dist == "exponential":
        return max(1, min(int(rng.expovariate(1.0 / mean)), 8 * mean))
    raise ValueError(f"unknown length distribution {dist!r}; choose fixed, uniform or exponential")


def arrival_times(cfg: WorkloadConfig, n: int, rng: random.Random) -> list[float]:
    if math.isinf(cfg.request_rate) or cfg.request_rate <= 0:
        return [0.0] * n
    t = 0.0
    out = []
    for _ in range(n):
        if cfg.arrival == "poisson":
            t += rng.expovariate(cfg.request_rate)
        elif cfg.arrival == "bursty":  # gamma with mean 1/rate and CV burstiness
            shape = 1.0 / (cfg.burstiness ** 2)
            t += rng.gammavariate(shape, 1.0 / (cfg.request_rate * shape))
        else:
            raise ValueError(f"unknown arrival process {cfg.arrival!r}; choose poisson or bursty")
        out.append(t)
    return out


def generate(cfg: WorkloadConfig) -> list[RequestSpec]:
    """Seeded request specs sorted by arrival (ties keep generation order)."""
    rng = random.Random(cfg.seed)
    prios = parse_weights(cfg.priority_classes, "--priority-classes")
    tenants = parse_weights(cfg.tenants, "--tenants")
    slos = parse_weights(cfg.ttft_slo_classes, "--ttft-slo-classes")
    if slos and cfg.ttft_slo_ms is not None:
        raise ValueError("--ttft-slo-ms and --ttft-slo-classes exclude each other")
    n = cfg.num_requests
    times = arrival_times(cfg, n, rng)
    seed_key = (cfg.seed + 1) * 1_000_003
    max_prompt = max(cfg.context_len - 2, 1)
    specs: list[RequestSpec] = []

    def pick(choices: list[tuple[str, float]]) -> str | None:
        if not choices:
            return None
        return rng.choices([c for c, _ in choices], weights=[w for _, w in choices])[0]

    def classify(spec: RequestSpec) -> None:
        p = pick(prios)
        spec.priority = int(p) if p is not None else None
        spec.tenant = pick(tenants)
        slo = pick(slos)
        spec.deadline_ms = float(slo) if slo is not None else cfg.ttft_slo_ms
        spec.tpot_slo_ms = cfg.tpot_slo_ms

    if cfg.workload in ("random", "shared-prefix"):
        prefix_len = 1024 if cfg.prefix_len is None else cfg.prefix_len
        for i in range(n):
            out_len = _length(rng, cfg.output_len, cfg.len_dist, cfg.range_ratio)
            own = _length(rng, cfg.input_len, cfg.len_dist, cfg.range_ratio)
            spec = RequestSpec(f"r{i}", times[i], own, out_len, stream=seed_key + i)
            if cfg.workload == "shared-prefix":
                spec.prefix_group = rng.randrange(cfg.num_prefix_groups)
                spec.prefix_len = prefix_len
                spec.prompt_len = prefix_len + own
            spec.prompt_len = min(spec.prompt_len, max_prompt)
            spec.prefix_len = min(spec.prefix_len, spec.prompt_len - 1)
            classify(spec)
            specs.append(spec)
    elif cfg.workload == "multi-turn":
        # conversations start on the arrival process; turn t+1 comes think_time (exp.) after turn t.
        # With a prefix_len, conversation c opens with system prompt c % num_prefix_groups (chosen
        # without the rng, so a workload without one draws exactly what it drew before).
        n_conv = max(1, math.ceil(n / cfg.num_turns))
        system = min(cfg.prefix_len or 0, max_prompt - 1)
        for c in range(n_conv):
            t = times[c]
            prompt = system + _length(rng, cfg.input_len, cfg.len_dist, cfg.range_ratio)
            tenant_prio: tuple[int | None, str | None, float | None] | None = None
            for turn in range(cfg.num_turns):
                if len(specs) >= n or prompt >= max_prompt:
                    break
                out_len = _length(rng, cfg.output_len, cfg.len_dist, cfg.range_ratio)
                spec = RequestSpec(f"c{c}t{turn}", t, prompt, out_len, stream=seed_key + c, conversation=c, turn=turn)
                if system > 0:
                    spec.prefix_group, spec.prefix_len = c % max(cfg.num_prefix_groups, 1), system
                if tenant_prio is None:
                    classify(spec)
                    tenant_prio = (spec.priority, spec.tenant, spec.deadline_ms)
                else:
                    spec.priority, spec.tenant, spec.deadline_ms = tenant_prio
                specs.append(spec)
                prompt += out_len + _length(rng, cfg.turn_len, cfg.len_dist, cfg.range_ratio)
                t += rng.expovariate(1.0 / cfg.think_time) if cfg.think_time > 0 else 0.0
    else:
        raise ValueError(f"unknown workload {cfg.workload!r}; choose random, shared-prefix or multi-turn")
    specs.sort(key=lambda s: s.arrival_time)
    return specs


# --- JSONL traces ---------------------------------------------------------------------------------
TRACE_FIELDS = ("arrival_time", "prompt_len", "input_ids", "output_len", "priority", "tenant", "deadline_ms",
                "tpot_slo_ms", "prefix_group", "prefix_len", "conversation", "turn", "rid", "stream")


def write_trace(specs: Iterable[RequestSpec], path: str | Path) -> None:
    """One JSON object a line; None fields left out."""
    with open(path, "w") as f:
        for s in specs:
            d = {k: v for k, v in asdict(s).items() if v is not None}
            f.write(json.dumps(d) + "\n")


def read_trace(path: str | Path, context_len: int | None = None) -> list[RequestSpec]:
    """Fields: arrival_time (s), prompt_len or input_ids, output_len; optional priority, tenant,
    deadline_ms, tpot_slo_ms, prefix_group (+ prefix_len), conversation, turn, rid, stream. Sorted by arrival."""
    known = {f.name for f in fields(RequestSpec)}
    specs = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            d = json.loads(line)
            unknown = set(d) - known
            if unknown:
                raise ValueError(f"{path}:{lineno}: unknown trace fields {sorted(unknown)}")
            if "input_ids" in d:
                d.setdefault("prompt_len", len(d["input_ids"]))
            if "prompt_len" not in d or "output_len" not in d or "arrival_time" not in d:
                raise ValueError(f"{path}:{lineno}: arrival_time, prompt_len (or input_ids) and output_len are required")
            d.setdefault("rid", f"t{lineno}")
            d.setdefault("stream", 7_000_003 * lineno + 17)
            if d.get("prefix_group") is not None:
                d.setdefault("prefix_len", min(512, d["prompt_len"] - 1))
            spec = RequestSpec(**d)
            if context_len is not None and spec.input_ids is None:
                spec.prompt_len = min(spec.prompt_len, context_len - 2)
                spec.prefix_len = min(spec.prefix_len, spec.prompt_len - 1)
            specs.append(spec)
    specs.sort(key=lambda s: s.arrival_time)
    return specs
