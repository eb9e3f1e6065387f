"""Step-time models for the simulated runner: how long one ``ForwardBatch`` takes on a GPU.

``h100-llama2-7b`` (default), per step::

    t = sum over non-attention operators of interp(op, num_tokens) x num_layers   (measured table)
      + emb(num_tokens)                                                        (once, not per layer)
      + KV bytes read by attention / HBM bandwidth                             (memory bound part)
      + prefill attention FLOPs / (tensor-core peak x efficiency)              (compute bound part)
      + fixed per-step overhead (launches, sampling, host<->device sync)

and a prefix loaded back from the host tier (``--enable-hierarchical-cache``) takes
``pcie_latency + KV bytes / pcie bandwidth`` on the worker's host link, one load after another,
overlapped with the steps (the request waits, the GPU does not). Copies out to the host ride the
other direction of the link beside the compute and are not charged.

The operator times are Vidur's measurements of Llama-2-7B on one H100 (TP=1, median), made
monotone (running maximum over num_tokens), interpolated linearly in ``num_tokens`` between table
points and extrapolated proportionally (per token) past 4096.
``linear`` is a two-parameter model for what-ifs and tests: ``ms_per_step + ms_per_token x tokens``.
"""

from __future__ import annotations

import bisect
import csv
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

# The non-attention operators of one layer in the table; ``add`` (residual) runs twice per layer.
LAYER_OPS: dict[str, int] = {
    "input_layernorm": 1, "attn_pre_proj": 1, "attn_rope": 1, "attn_post_proj": 1,
    "post_attention_layernorm": 1, "mlp_up_proj": 1, "mlp_act": 1, "mlp_down_proj": 1, "add": 2,
}
BUNDLED_TABLE = Path(__file__).resolve().parent / "data" / "h100_llama2_7b_tp1.csv"
SHARED_TABLE_REL = Path("shared") / "data" / "vidur-h100-llama-2-7b" / "mlp.csv"


def shared_table_path() -> Path:
    """``../shared/data/vidur-h100-llama-2-7b/mlp.csv`` beside the repository root (CI layout)."""
    return Path(__file__).resolve().parents[2].parent / SHARED_TABLE_REL


@dataclass(frozen=True)
class DraftModelSim:
    """The simulated draft model of ``--speculative-algorithm draft``: each draft token is the
    request's own next token with probability ``acceptance`` (independently, so a request keeps
    ``i`` drafts with probability ``acceptance ** i``), and each of a step's ``k`` draft forwards
    costs ``cost`` times the target's decode step over the same batch."""

    acceptance: float = 0.7
    cost: float = 0.05


class CostModel(Protocol):
    name: str
    draft: DraftModelSim | None  # the simulated draft model, where one is simulated

    def step_time(self, prefix_lens: Sequence[int], extend_lens: Sequence[int]) -> float:
        """Seconds for one forward over requests with these cached prefixes and new tokens."""
        ...

    def kv_bytes_per_token(self) -> int:
        """KV bytes a token takes on the device (every layer's K and V)."""
        ...

    def tier_load_s(self, tokens: int) -> float:
        """Seconds to move ``tokens`` tokens of KV from the host tier into the device pool."""
        ...


@dataclass
class OpTable:
    """Per-layer operator milliseconds indexed by num_tokens (sorted, strictly increasing)."""

    num_tokens: list[int]
    ops: dict[str, list[float]]

    def per_layer_ms(self) -> list[float]:
        n = len(self.num_tokens)
        return [sum(self.ops[op][i] * k for op, k in LAYER_OPS.items()) for i in range(n)]

    @classmethod
    def load_bundled(cls, path: Path = BUNDLED_TABLE) -> OpTable:
        with open(path) as f:
            rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
        ops = [c for c in rows[0] if c != "num_tokens"]
        return cls([int(r["num_tokens"]) for r in rows], {op: [float(r[op]) for r in rows] for op in ops})

    @classmethod
    def load_vidur(cls, path: Path | None = None, tp: int = 1) -> OpTable:
        """The full Vidur ``mlp.csv`` (median per operator at TP ``tp``; duplicate rows averaged)."""
        path = path or shared_table_path()
        if not path.exists():
            raise FileNotFoundError(
                f"{path} not found: the measured table lives in ../shared/data/vidur-h100-llama-2-7b/ beside "
                f"the repository; the simulator's default uses the bundled copy {BUNDLED_TABLE} instead")
        acc: dict[int, list[dict[str, float]]] = {}
        with open(path) as f:
            for r in csv.DictReader(f):
                if int(r["num_tensor_parallel_workers"]) != tp:
                    continue
                acc.setdefault(int(r["num_tokens"]), []).append(
                    {op: float(r[f"time_stats.{op}.median"]) for op in ["emb", *LAYER_OPS]})
        if not acc:
            raise ValueError(f"no rows with num_tensor_parallel_workers={tp} in {path}")
        ns = sorted(acc)
        ops = {op: [sum(d[op] for d in acc[n]) / len(acc[n]) for n in ns] for op in ["emb", *LAYER_OPS]}
        return cls(ns, ops)


def interp(xs: Sequence[int], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through the points; below the first point linear through the first two
    (clamped at zero), past the last proportional to ``x`` (the table ends in the compute-bound regime)."""
    if x <= xs[0]:
        if len(xs) == 1:
            return ys[0]
        slope = (ys[1] - ys[0]) / (xs[1] - xs[0])
        return max(ys[0] + slope * (x - xs[0]), 0.0)
    if x >= xs[-1]:  # past the table: proportional to tokens (compute bound there)
        return ys[-1] * x / xs[-1]
    i = bisect.bisect_left(xs, x)
    if xs[i] == x:
        return ys[i]
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(y0 + (y1 - y0) * (x - x0) / (x1 - x0), 0.0)


@dataclass
class H100Llama2CostModel:
    """Measured operators + analytic attention; see the module docstring and docs/simulator.md."""

    table: OpTable
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int = 32  # Llama-2-7B has no GQA; 8 models a Llama-3-8B's KV traffic
    head_dim: int = 128
    kv_bytes_per_elem: int = 2  # fp16/bf16 KV
    hbm_bytes_per_s: float = 3.0e12  # measured device-copy bandwidth (nominal 3.35e12)
    tensor_flops: float = 600e12  # bf16 dense tensor-core rate usable by attention kernels
    attn_efficiency: float = 0.5  # achieved fraction of tensor_flops in prefill attention
    step_overhead_s: float = 0.5e-3  # launches, sampling, scheduler<->GPU sync per step
    # host -> device: H100 SXM's PCIe Gen5 x16 moves ~64 GB/s a direction nominal; pinned copies
    # reach ~50-55
    pcie_bytes_per_s: float = 50e9
    pcie_latency_s: float = 10e-6  # a transfer's fixed cost (launch, DMA setup)
    monotone: bool = True  # use the table's running maximum: more tokens never make a step cheaper
    name: str = "h100-llama2-7b"
    draft: DraftModelSim | None = None

    def __post_init__(self) -> None:
        self._xs = self.table.num_tokens
        self._layer = self.table.per_layer_ms()
        self._emb = list(self.table.ops["emb"])
        if self.monotone:  # the measurements dip by up to ~15% past GEMM tile sizes (e.g. 104 vs 96 tokens)
            self._layer = list(itertools.accumulate(self._layer, max))
            self._emb = list(itertools.accumulate(self._emb, max))

    def layer_ms_points(self) -> tuple[list[int], list[float], list[float]]:
        """(num_tokens, per-layer ms, emb ms) the interpolation passes through exactly."""
        return list(self._xs), list(self._layer), list(self._emb)

    def linear_ms(self, num_tokens: int) -> float:
        """Non-attention time of the whole model for ``num_tokens`` tokens, in ms."""
        if num_tokens <= 0:
            return 0.0
        return interp(self._xs, self._layer, num_tokens) * self.num_layers + interp(self._xs, self._emb, num_tokens)

    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_bytes_per_elem

    def tier_load_s(self, tokens: int) -> float:
        return self.pcie_latency_s + tokens * self.kv_bytes_per_token() / self.pcie_bytes_per_s

    def attention_s(self, prefix_lens: Sequence[int], extend_lens: Sequence[int]) -> float:
        """KV read over HBM (every request reads its whole context once per step) plus prefill FLOPs."""
        ctx_tokens = 0
        flops = 0.0
        per = 4.0 * self.num_heads * self.head_dim * self.num_layers
        for p, n in zip(prefix_lens, extend_lens, strict=True):
            ctx_tokens += p + n
            if n > 1:  # causal: the n new queries see p + (n+1)/2 keys on average
                flops += per * n * (p + (n + 1) / 2)
        mem = ctx_tokens * self.kv_bytes_per_token() / self.hbm_bytes_per_s
        return mem + flops / (self.tensor_flops * self.attn_efficiency)

    def step_time(self, prefix_lens: Sequence[int], extend_lens: Sequence[int]) -> float:
        tokens = sum(extend_lens)
        return self.linear_ms(tokens) / 1e3 + self.attention_s(prefix_lens, extend_lens) + self.step_overhead_s


@dataclass
class LinearCostModel:
    """``ms_per_step + ms_per_token x new tokens + ms_per_context_token x context tokens read``."""

    ms_per_step: float = 10.0
    ms_per_token: float = 0.1
    ms_per_context_token: float = 0.0
    ms_per_loaded_token: float = 0.0  # a prefix loaded from the host tier, per token
    name: str = "linear"
    draft: DraftModelSim | None = None

    def kv_bytes_per_token(self) -> int:
        return 2 * 32 * 32 * 128 * 2  # what the h100 model's Llama-2-7B takes: sizes the host tier

    def tier_load_s(self, tokens: int) -> float:
        return self.ms_per_loaded_token * tokens / 1e3

    def step_time(self, prefix_lens: Sequence[int], extend_lens: Sequence[int]) -> float:
        tokens = sum(extend_lens)
        ctx = sum(prefix_lens) + tokens
        return (self.ms_per_step + self.ms_per_token * tokens + self.ms_per_context_token * ctx) / 1e3


COST_MODELS = ("h100-llama2-7b", "h100-llama2-7b-shared", "linear")


def make_cost_model(
    name: str = "h100-llama2-7b",
    *,
    num_kv_heads: int = 32,
    step_overhead_ms: float = 0.5,
    ms_per_step: float = 10.0,
    ms_per_token: float = 0.1,
    ms_per_context_token: float = 0.0,
    draft: DraftModelSim | None = None,
    pcie_gbps: float = 50.0,
    ms_per_loaded_token: float = 0.0,
    kv_bytes_per_elem: int = 2,
) -> CostModel:
    """``h100-llama2-7b``: the bundled table; ``h100-llama2-7b-shared``: read ../shared's full CSV;
    ``linear``: the two/three-parameter model. ``draft``: a simulated draft model as well.
    ``kv_bytes_per_elem``: the h100 model's KV bytes per value (1: fp8 / int8 KV)."""
    if name == "linear":
        return LinearCostModel(ms_per_step, ms_per_token, ms_per_context_token, ms_per_loaded_token, draft=draft)
    if name == "h100-llama2-7b":
        table = OpTable.load_bundled()
    elif name == "h100-llama2-7b-shared":
        table = OpTable.load_vidur()
    else:
        raise ValueError(f"unknown cost model {name!r}; choose from {', '.join(COST_MODELS)}")
    return H100Llama2CostModel(table, num_kv_heads=num_kv_heads, step_overhead_s=step_overhead_ms / 1e3,
                               pcie_bytes_per_s=pcie_gbps * 1e9, kv_bytes_per_elem=kv_bytes_per_elem, draft=draft)
