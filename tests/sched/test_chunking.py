"""--enable-mixed-chunk (a prefill chunk and the running decodes in one MIXED forward) and
--enable-dynamic-chunking (the chunk sized to a target step time while requests decode)."""

from __future__ import annotations

from tests.fakes import drain, expected_tokens, make_scheduler
from tests.sched.sched_helpers import prompt, submit, tokens


def _workload(sched) -> dict[str, list[int]]:  # type: ignore[no-untyped-def]
    """Two short requests start decoding; then a long prompt arrives and is prefilled in chunks."""
    submit(sched, "s1", prompt(1, 8), 30)
    submit(sched, "s2", prompt(2, 9), 30)
    outs = [*sched.step(), *sched.step()]  # their prefill, one decode
    submit(sched, "long", prompt(3, 100), 5)
    return tokens(outs + drain(sched))


def test_mixed_chunk_decodes_during_the_long_prefill_with_the_same_outputs() -> None:
    plain, _, _ = make_scheduler(pool_tokens=512, chunked_prefill_size=32)
    mixed, runner, _ = make_scheduler(pool_tokens=512, chunked_prefill_size=32, enable_mixed_chunk=True)
    assert _workload(plain) == _workload(mixed)
    assert _workload(make_scheduler(pool_tokens=512)[0])["long"] == expected_tokens(prompt(3, 100), 5)
    modes = [(e[0], e[1], e[2]) for e in mixed.stats.step_log]
    chunks = [m for m in modes if m[0] == "MIXED"]
    # the long prompt's chunks each carried the two decodes: 32 - 2 prompt tokens + 2 decode tokens
    assert chunks[:3] == [("MIXED", 3, 32)] * 3
    assert mixed.stats.num_finished == 3
    # without mixing, the decodes wait out every chunk: no MIXED step, more steps in all
    assert not any(e[0] == "MIXED" for e in plain.stats.step_log)
    assert len(plain.stats.step_log) > len(mixed.stats.step_log)


def test_dynamic_chunk_budget_follows_the_measured_speed() -> None:
    sched, _, _ = make_scheduler(pool_tokens=1024, chunked_prefill_size=256, enable_dynamic_chunking=True,
                                 dynamic_chunk_target_ms=50.0)
    est = sched.deadlines.throughput
    est.tokens_per_s, est.decode_step_s = 1000.0, 0.02
    assert sched.builder.chunk_budget() == 256  # nobody decodes: the whole chunk
    submit(sched, "s", prompt(4, 8), 50)
    sched.step()
    sched.step()
    est.tokens_per_s, est.decode_step_s = 1000.0, 0.02  # (the fake runner's steps measured ~0 s)
    assert sched.builder.chunk_budget() == 50  # 50 ms at 1,000 tokens/s
    est.tokens_per_s = 100000.0
    assert sched.builder.chunk_budget() == 256  # never above --chunked-prefill-size
    est.tokens_per_s = 10.0
    assert sched.builder.chunk_budget() == 32  # never below 32 tokens
    sched.settings.args = sched.settings.args.replace(enable_mixed_chunk=True)
    est.tokens_per_s = 1000.0
    assert sched.builder.chunk_budget() == 32  # mixed: 50 ms less a 20 ms decode step = 30 tokens, floor 32
    est.decode_step_s = 0.005
    assert sched.builder.chunk_budget() == 45


def test_dynamic_chunks_in_a_run() -> None:
    sched, _, _ = make_scheduler(pool_tokens=1024, chunked_prefill_size=256, enable_dynamic_chunking=True,
                                 dynamic_chunk_target_ms=40.0)
    sched.deadlines.throughput.tokens_per_s = 1000.0
    submit(sched, "s", prompt(5, 8), 40)
    sched.step()
    sched.step()
    submit(sched, "long", prompt(6, 150), 3)
    outs = drain(sched)
    extends = [e[2] for e in sched.stats.step_log if e[0] == "EXTEND"][1:]
    assert extends[0] <= 40 < 150  # chunked to the target while "s" decodes (the EMA moves after)
    assert tokens(outs)["long"] == expected_tokens(prompt(6, 150), 3)


def test_dynamic_chunking_lets_the_running_requests_decode_between_chunks() -> None:
    sched, _, _ = make_scheduler(pool_tokens=1024, chunked_prefill_size=32, enable_dynamic_chunking=True)
    submit(sched, "s", prompt(7, 8), 40)
    sched.step()
    sched.step()
    submit(sched, "long", prompt(8, 100), 3)
    drain(sched)
    modes = [e[0] for e in sched.stats.step_log][2:]
    last = max(i for i, m in enumerate(modes) if m == "EXTEND")
    chunks = modes[: last + 1]  # the steps until the last chunk
    assert chunks.count("EXTEND") == 4  # 100 tokens in chunks of 32 (the fake's steps measure ~0 s)
    assert all(a != b for a, b in zip(chunks, chunks[1:], strict=False))  # a decode after every chunk
