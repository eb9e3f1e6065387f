"""The simulator: determinism, cost-model sanity, policy effects, KV pressure, traces, CLI."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from radixserve.cli import main as cli_main
from radixserve.config import ServerArgs
from radixserve.sched.core import SchedulerCore
from radixserve.sim.cost_model import (
    BUNDLED_TABLE,
    DraftModelSim,
    H100Llama2CostModel,
    LinearCostModel,
    OpTable,
    make_cost_model,
    shared_table_path,
)
from radixserve.sim.options import args_for
from radixserve.sim.report import summary_text
from radixserve.sim.simulator import run
from radixserve.sim.summary import summarize
from radixserve.sim.workload import (
    RequestSpec,
    WorkloadConfig,
    generate,
    read_trace,
    stream_token,
    stream_tokens,
    write_trace,
)

CTX = 2048


def _sim(policy: str = "fcfs", seed: int = 0, **wl: Any) -> dict:
    cfg = WorkloadConfig(**{"num_requests": 60, "request_rate": 50.0, "input_len": 64, "output_len": 24,
                            "context_len": CTX, "seed": seed, **wl})  # type: ignore[arg-type]
    args = ServerArgs(max_total_tokens=20000, max_running_requests=32, schedule_policy=policy, random_seed=seed)
    return summarize(run(args, generate(cfg), make_cost_model(), CTX))


def _without_wall(d: dict) -> dict:
    return {k: v for k, v in d.items() if k != "wall"}


def test_same_seed_same_result_and_different_seed_differs() -> None:
    kw: dict[str, Any] = {"workload": "shared-prefix", "prefix_len": 128, "priority_classes": "0:0.5,10:0.5", "tenants": "a:3,b:1",
          "ttft_slo_ms": 50.0}
    a, b = _sim("lpm", **kw), _sim("lpm", **kw)
    assert _without_wall(a) == _without_wall(b)
    assert a["completed"] == 60 and a["aborted"] == 0
    assert set(a["per_class"]) == {"priority=0", "priority=10", "tenant=a", "tenant=b"}
    c = _sim("lpm", seed=1, **kw)
    assert _without_wall(c) != _without_wall(a)


def test_streaming_requests_change_the_outputs_sent_not_the_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--stream-output``: every decode step emits every request's token; the schedule, the tokens
    and every figure of the result stay the same."""
    cfg = WorkloadConfig(num_requests=40, request_rate=50.0, input_len=64, output_len=24, context_len=CTX,
                         workload="shared-prefix", prefix_len=128)
    args = ServerArgs(max_total_tokens=20000, max_running_requests=32, schedule_policy="lpm")
    specs = generate(cfg)
    sent = [0]  # outputs of unfinished requests
    step = SchedulerCore.step

    def counting_step(self: SchedulerCore) -> list:
        outs = step(self)
        sent[0] += sum(1 for o in outs if o.finished_reason is None)
        return outs

    monkeypatch.setattr(SchedulerCore, "step", counting_step)
    results, emitted = {}, {}
    for stream in (False, True):
        sent[0] = 0
        results[stream] = _without_wall(summarize(run(args, specs, make_cost_model(), CTX, stream=stream)))
        emitted[stream] = sent[0]
    assert results[False] == results[True]
    assert emitted[False] == 40  # each request's first token, then only its finish
    assert emitted[True] > 40 * 20


def test_interpolation_exact_at_table_points_and_monotone() -> None:
    table = OpTable.load_bundled()
    raw = H100Llama2CostModel(table, monotone=False)
    per_layer = table.per_layer_ms()
    for i in (0, 5, 50, len(table.num_tokens) - 1):
        n = table.num_tokens[i]
        assert raw.linear_ms(n) == pytest.approx(per_layer[i] * 32 + table.ops["emb"][i])
    m = H100Llama2CostModel(table)  # the default: the table's running maximum
    xs, layer, emb = m.layer_ms_points()
    for x, y, e in zip(xs, layer, emb, strict=True):
        assert m.linear_ms(x) == pytest.approx(y * 32 + e)
        assert y >= per_layer[xs.index(x)]
    assert m.linear_ms(4096) == raw.linear_ms(4096) or layer[-1] > per_layer[-1]
    # midpoint of two table points is the mean of their values
    assert m.linear_ms(20) == pytest.approx((m.linear_ms(16) + m.linear_ms(24)) / 2)
    times = [m.linear_ms(n) for n in range(1, 10000, 3)]
    assert all(b >= a for a, b in zip(times, times[1:], strict=False))
    assert m.linear_ms(8192) > m.linear_ms(4096) > m.linear_ms(512) > m.linear_ms(1)
    # a decode step: 7B weights once per step (~5-6 ms at batch 1)
    assert 4.0 < m.step_time([100], [1]) * 1e3 < 8.0
    # prefill time grows with tokens; decode time grows with context
    assert m.step_time([0], [2048]) > m.step_time([0], [1024]) > m.step_time([0], [128])
    assert m.step_time([4000] * 64, [1] * 64) > m.step_time([1000] * 64, [1] * 64) > m.step_time([10] * 64, [1] * 64)
    # one 1024-token context read = 512 KiB/token (Llama-2-7B, 32 KV heads) x 1024 / 3 TB/s
    assert m.attention_s([1023], [1]) == pytest.approx(1024 * 2 * 32 * 32 * 128 * 2 / 3.0e12)
    lin = LinearCostModel(ms_per_step=5.0, ms_per_token=0.5)
    assert lin.step_time([0, 7], [10, 1]) == pytest.approx((5.0 + 0.5 * 11) / 1e3)


def test_bundled_table_matches_shared_csv() -> None:
    path = shared_table_path()
    if not path.exists():
        pytest.skip(f"{path} not present")
    full, small = OpTable.load_vidur(path), OpTable.load_bundled()
    assert full.num_tokens == small.num_tokens
    for a, b in zip(full.per_layer_ms(), small.per_layer_ms(), strict=True):
        assert a == pytest.approx(b, rel=1e-3)
    assert BUNDLED_TABLE.exists()


def test_missing_shared_table_has_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="shared/data/vidur"):
        OpTable.load_vidur(tmp_path / "shared" / "data" / "vidur-h100-llama-2-7b" / "mlp.csv")


def test_lpm_hits_the_cache_at_least_as_often_as_fcfs() -> None:
    kw = {"workload": "shared-prefix", "prefix_len": 256, "num_prefix_groups": 6, "num_requests": 120,
          "request_rate": float("inf")}
    cfg = WorkloadConfig(**{"input_len": 32, "output_len": 16, "context_len": CTX, **kw})  # type: ignore[arg-type]
    specs = generate(cfg)
    rates = {}
    for policy in ("fcfs", "lpm"):
        # a small pool: groups evict each other under fcfs's interleaving
        args = ServerArgs(max_total_tokens=2500, max_running_requests=8, schedule_policy=policy)
        rates[policy] = summarize(run(args, specs, make_cost_model(), CTX))["cache_hit_rate"]
    assert rates["lpm"] >= rates["fcfs"] > 0.0


def test_kv_pressure_retracts_and_keeps_the_memory_invariant() -> None:
    cfg = WorkloadConfig(num_requests=40, request_rate=float("inf"), input_len=64, output_len=200, len_dist="fixed",
                         context_len=CTX)
    args = ServerArgs(max_total_tokens=3000, max_running_requests=32, schedule_policy="fcfs")
    seen: dict[str, Any] = {"max_running": 0}

    def on_step(s: Any) -> None:
        seen["sched"] = s
        seen["max_running"] = max(seen["max_running"], len(s.queues.running.reqs))

    trace = run(args, generate(cfg), make_cost_model(), CTX, on_step=on_step, check_invariant=True)
    res = summarize(trace)
    assert res["retractions"]["total"] > 0 and res["retractions"]["per_request"] > 0
    assert res["completed"] == 40 and seen["max_running"] > 1
    # every request got exactly its sampled output length (EOS at the sampled length)
    assert all(r.output_len == 200 for r in trace.records)
    # drained: every KV slot free or cached, nothing locked, every request slot free
    sched = seen["sched"]
    assert not sched.has_work()
    sched.kv.check_invariant()
    assert sched.kv.req_to_token_pool.available_size() == sched.kv.req_to_token_pool.size


def test_unified_scheduler_and_priority_run() -> None:
    cfg = WorkloadConfig(num_requests=40, request_rate=float("inf"), input_len=64, output_len=100, len_dist="fixed",
                         priority_classes="0:0.5,100:0.5", context_len=CTX)
    specs = generate(cfg)
    base = ServerArgs(max_total_tokens=2500, max_running_requests=32)
    for item in ("unified", "priority", "lpm:lpm_fallback_threshold=0"):
        label, args = args_for(base, item)
        res = summarize(run(args, specs, make_cost_model(), CTX, label=label))
        assert res["completed"] == 40 and res["label"] == item
    _, a = args_for(base, "lpm:lpm_fallback_threshold=0:max_running_requests=4")
    assert a.lpm_fallback_threshold == 0 and a.max_running_requests == 4 and a.schedule_policy == "lpm"
    with pytest.raises(ValueError):
        args_for(base, "nonsense")


def test_streams_and_multi_turn_prompts_contain_the_previous_answer() -> None:
    assert stream_tokens(123, 5, 40) == [stream_token(123, i) for i in range(5, 40)]
    cfg = WorkloadConfig(num_requests=8, workload="multi-turn", num_turns=4, input_len=50, output_len=10,
                         len_dist="fixed", turn_len=5, context_len=CTX)
    specs = [s for s in generate(cfg) if s.conversation == 0]
    t0, t1 = sorted(specs, key=lambda s: s.turn)[:2]
    answer = [stream_token(t0.stream, t0.stream_offset + k) for k in range(t0.output_len - 1)]
    assert t1.prompt_ids()[: t0.prompt_len + len(answer)] == t0.prompt_ids() + answer


def test_jsonl_trace_round_trip(tmp_path: Path) -> None:
    cfg = WorkloadConfig(num_requests=30, workload="shared-prefix", prefix_len=64, input_len=16,
                         priority_classes="0:0.5,5:0.5", tenants="x:1,y:1", ttft_slo_ms=100.0, context_len=CTX)
    specs = generate(cfg)
    specs.append(RequestSpec("explicit", 99.0, 3, 4, input_ids=[300, 301, 302]))
    path = tmp_path / "trace.jsonl"
    write_trace(specs, path)
    back = read_trace(path)
    assert back == sorted(specs, key=lambda s: s.arrival_time)
    # a minimal hand-written trace
    path2 = tmp_path / "min.jsonl"
    path2.write_text(json.dumps({"arrival_time": 0.5, "prompt_len": 20, "output_len": 3, "prefix_group": 1}) + "\n"
                     + json.dumps({"arrival_time": 0.1, "input_ids": [400, 401], "output_len": 2, "tenant": "t"}) + "\n")
    mini = read_trace(path2)
    assert [s.arrival_time for s in mini] == [0.1, 0.5] and mini[0].prompt_len == 2 and mini[1].prefix_len == 19
    res = summarize(run(ServerArgs(max_total_tokens=1000), mini, make_cost_model(), CTX))
    assert res["completed"] == 2


def test_cli_compare_output_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, png, trace = tmp_path / "r.json", tmp_path / "p.png", tmp_path / "t.jsonl"
    rc = cli_main(["simulate", "--num-requests", "30", "--request-rate", "100", "--input-len", "32",
                   "--output-len", "8", "--compare", "fcfs,lpm", "--output", str(out), "--plot", str(png),
                   "--save-trace", str(trace), "--no-progress", "--tenants", "a:2,b:1", "--max-total-tokens", "5000"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "| fcfs" in text and "| lpm" in text and "scheduler overhead" in text
    data = json.loads(out.read_text())
    assert [r["label"] for r in data["results"]] == ["fcfs", "lpm"]
    assert png.stat().st_size > 0 and len(trace.read_text().splitlines()) == 30
    rc = cli_main(["simulate", "--trace", str(trace), "--cost-model", "linear", "--no-progress"])
    assert rc == 0


def test_one_byte_kv_doubles_the_pool_and_halves_the_attention_reads(capsys: pytest.CaptureFixture[str]) -> None:
    """``--kv-cache-dtype fp8`` on the h100 model: a byte per value, so the default pool holds twice
    the tokens and a long-context decode step reads half the KV."""
    pools = {}
    for dtype in ("auto", "fp8"):
        assert cli_main(["simulate", "--num-requests", "4", "--input-len", "32", "--output-len", "4", "--no-progress",
                         "--kv-cache-dtype", dtype]) == 0
        err = capsys.readouterr().err
        pools[dtype] = int(err.split("KV pool ")[1].split()[0])
    assert pools["fp8"] in (2 * pools["auto"], 2 * pools["auto"] + 1)
    two, one = make_cost_model(), make_cost_model(kv_bytes_per_elem=1)
    assert isinstance(two, H100Llama2CostModel) and isinstance(one, H100Llama2CostModel)
    assert one.kv_bytes_per_token() * 2 == two.kv_bytes_per_token()
    assert one.attention_s([4000] * 64, [1] * 64) * 2 == pytest.approx(two.attention_s([4000] * 64, [1] * 64))


def test_help_explains_every_option() -> None:
    import argparse

    from radixserve.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    sim = sub.choices["simulate"]
    opts = [a for a in sim._actions if a.option_strings and a.dest != "help"]
    assert len(opts) > 40
    for a in opts:
        assert a.help and len(a.help) > 10, a.option_strings
    flags = {f for a in opts for f in a.option_strings}
    assert {"--compare", "--cost-model", "--trace", "--plot", "--schedule-policy", "--max-total-tokens"} <= flags


def test_ngram_speculation_runs_the_real_scheduler_and_keeps_every_request() -> None:
    """With n-gram drafts on, the simulator's requests finish with the same tokens (a draft is checked
    against the request's synthetic stream) and the memory invariant holds (``run`` checks it). Its
    random synthetic tokens rarely repeat, so little is drafted. The draft algorithm needs the cost
    model's simulated draft model."""
    cfg = WorkloadConfig(num_requests=12, request_rate=20.0, input_len=64, output_len=24, context_len=CTX, seed=3)
    base = ServerArgs(max_total_tokens=20000, max_running_requests=4)
    plain = summarize(run(base, generate(cfg), make_cost_model(), CTX))
    spec = summarize(run(base.replace(speculative_algorithm="ngram"), generate(cfg), make_cost_model(), CTX))
    assert spec["completed"] == plain["completed"] == 12
    assert spec["stats"]["generated_tokens"] == plain["stats"]["generated_tokens"]
    with pytest.raises(ValueError, match="simulated draft model"):
        run(base.replace(speculative_algorithm="draft"), generate(cfg), make_cost_model(), CTX)


@pytest.mark.parametrize("acceptance", [0.0, 0.5, 1.0])
def test_simulated_draft_model_acceptance_and_cost(acceptance: float) -> None:
    """A simulated draft model whose tokens are right with probability ``acceptance``: every request
    still ends with its own tokens, the accepted share follows ``acceptance`` (all, about
    ``sum a^i / sum 1`` of geometric runs, none), and the drafts' forwards are paid for: with
    nothing accepted, speculation only costs time; with everything accepted, it saves most of it."""
    cfg = WorkloadConfig(num_requests=8, request_rate=float("inf"), input_len=64, output_len=48, context_len=CTX, seed=4)
    base = ServerArgs(max_total_tokens=20000, max_running_requests=2)
    cost = make_cost_model(draft=DraftModelSim(acceptance, 0.05))
    plain = summarize(run(base, generate(cfg), cost, CTX))
    got = summarize(run(base.replace(speculative_algorithm="draft"), generate(cfg), cost, CTX))
    assert got["completed"] == plain["completed"] == 8
    assert got["stats"]["generated_tokens"] == plain["stats"]["generated_tokens"]
    st = got["stats"]
    assert st["spec_draft_tokens"] > 0
    rate = st["spec_accepted_tokens"] / st["spec_draft_tokens"]
    if acceptance == 1.0:
        assert rate == 1.0 and got["tpot_ms"]["p50"] < 0.5 * plain["tpot_ms"]["p50"]
    elif acceptance == 0.0:
        assert rate == 0.0 and got["tpot_ms"]["p50"] > plain["tpot_ms"]["p50"]
    else:
        assert 0.2 < rate < 0.6
    assert "speculation:" in summary_text(got)
