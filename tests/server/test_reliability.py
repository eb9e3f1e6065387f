"""The reliability suite's short versions on the shared server: ``radixserve bench fuzz``
(schemathesis over ``/openapi.json``) and ``radixserve bench soak`` (mixed requests with aborts,
disconnects and invalid ones, then no leaked KV or request slot). The long runs and their
figures: docs/reliability.md."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from radixserve.bench.fuzz import clamp_lengths
from tests.server.helpers import ServerProcess, assert_memory_ok

pytestmark = pytest.mark.slow  # real servers: the full tier only (scripts/test.sh --fast leaves it out)


def _run(out: Path, *args: str) -> tuple[int, dict[str, Any]]:
    from radixserve.cli import main

    code = main([*args, "--output", str(out), "--disable-tqdm"])
    return code, json.loads(out.read_text())


def test_schemathesis_fuzz_short(shared_server: ServerProcess, tmp_path: Path) -> None:
    """Every documented route, positive and negative cases: no 5xx, healthy after. The shared server
    has a long context, so generated lengths are capped; its scheduling policy must not change."""
    code, rep = _run(tmp_path / "fuzz.json", "bench", "fuzz", "--base-url", shared_server.url, "--cases", "120",
                     "--mutations", "30", "--clamp-tokens", "8", "--skip-routes", "/set_schedule_policy",
                     "--timeout", "60")
    assert rep["5xx"] == 0 and not rep["failures"], rep["failures"]
    assert rep["schemathesis_cases"] >= 120 and rep["mutation_cases"] == 30
    ops = rep["per_operation"]
    for op in ("POST /v1/chat/completions (positive)", "POST /v1/completions (negative)",
               "POST /generate (positive)", "GET /v1/models (positive)", "GET /health (positive)"):
        assert ops.get(op, 0) >= 1, (op, ops)
    assert rep["statuses"]["schemathesis"].get("200", 0) >= 10, rep["statuses"]  # some reach the engine
    assert rep["health"]["ok"], rep["health"]
    assert code == 0


def test_clamp_lengths_caps_only_in_range_values() -> None:
    body = {"max_tokens": 10**6, "n": 64, "sampling_params": [{"max_new_tokens": 2**63 - 1}, {"top_k": 5}]}
    assert clamp_lengths(body, 8) == {"max_tokens": 8, "n": 4, "sampling_params": [
        {"max_new_tokens": 8}, {"top_k": 5, "max_new_tokens": 8}]}
    for bad in (-1, 2**64, True, "9"):
        assert clamp_lengths({"max_tokens": bad}, 8) == {"max_tokens": bad}
    assert clamp_lengths({"messages": []}, 8) == {"messages": [], "max_tokens": 8}
    assert clamp_lengths({"input": ""}, 8) == {"input": "", "max_output_tokens": 8}
    assert clamp_lengths({"input": "x", "max_output_tokens": 3}, 8) == {"input": "x", "max_output_tokens": 3}


def test_soak_short(shared_server: ServerProcess, tmp_path: Path) -> None:
    """120 requests: every fate ends as it should, the pools are back to idle sizes (checked by the
    command, and again here), RSS is read at each phase (its growth limit is for long runs)."""
    code, rep = _run(tmp_path / "soak.json", "bench", "soak", "--base-url", shared_server.url,
                     "--num-requests", "110", "--warmup", "10", "--concurrency", "8", "--max-output-len", "3",
                     "--max-prompt-len", "96", "--abort-frac", "0.1", "--disconnect-frac", "0.1",
                     "--invalid-frac", "0.1", "--max-rss-growth", "1000", "--seed", "3")
    assert rep["ok"], rep["problems"]
    outcomes = rep["outcomes"]
    assert not any(k.endswith("failed") for k in outcomes), outcomes
    assert sum(outcomes.values()) == 120
    assert outcomes.get("normal: ok", 0) > 60 and outcomes.get("invalid: refused", 0) > 5
    assert outcomes.get("abort: aborted", 0) > 5 and outcomes.get("disconnect: disconnected", 0) > 5
    assert all(rep["rss_mb"][k] and set(rep["rss_mb"][k]) >= {"http", "scheduler", "detokenizer"}
               for k in ("start", "after_warmup", "end"))
    assert_memory_ok(rep["memory_end"])
    assert code == 0


def test_soak_workload_is_seeded_and_mixed() -> None:
    import argparse

    from radixserve.bench.soak import add_args, make_jobs

    p = argparse.ArgumentParser()
    add_args(p)
    ns = p.parse_args(["--max-prompt-len", "100", "--max-output-len", "4"])
    jobs = make_jobs(2000, 5, ns, vocab=1000, context=128)
    again = make_jobs(2000, 5, ns, vocab=1000, context=128)
    assert [(j.route, j.fate, j.body) for j in jobs] == [(j.route, j.fate, j.body) for j in again]
    fates = {f: sum(j.fate == f for j in jobs) for f in ("normal", "abort", "disconnect", "invalid")}
    for f in ("abort", "disconnect", "invalid"):
        assert 60 < fates[f] < 140, fates  # 5% of 2000
    assert {j.route for j in jobs} == {"/v1/completions", "/v1/chat/completions", "/generate"}
    for j in jobs:
        assert 1 <= j.prompt_len <= 100 and j.prompt_len + j.output_len < 128
        if j.fate == "abort":
            assert j.route == "/generate" and j.stream and isinstance(j.body, dict) and j.body["rid"]
        if j.fate == "normal":
            assert 1 <= j.output_len <= 4
    streamed = sum(j.stream for j in jobs if j.fate == "normal") / fates["normal"]
    assert 0.4 < streamed < 0.6
