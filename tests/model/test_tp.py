"""Tensor parallelism: greedy tokens under ``tp_size`` N equal tp_size 1 through the engine (rank 0
in this process, the other ranks spawned), the sharded KV pool, the refusal of a tp size the
model's heads do not allow, and the pieces (request-table journal, shard ranges, options)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from radixserve.config import ServerArgs
from radixserve.engine import Engine
from radixserve.mem.forward_batch import ForwardBatch, SamplingBatchInfo, VerifyRows
from radixserve.mem.kv_pool import JournaledReqToTokenPool, ReqToTokenPool, replay_journal
from radixserve.model.config import ModelConfig
from radixserve.model.parallel import TPGroup, check_tp_size, recv_step, send_step
from tests.model.tiny_llama import make_tiny_llama

GREEDY = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
PREFIX = "A shared system prompt that several requests start with: "
PROMPTS = [PREFIX + "first question?", PREFIX + "second, longer question here?", "short", "x" * 40]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama")))


def _run(engine: Engine) -> list[Any]:
    """The first prompt alone, then the rest together (the shared prefix comes from the cache), then
    the second again with its prompt logprobs from token 20 (the extra logits rows gathered too)."""
    first = engine.generate(PROMPTS[0], GREEDY)
    rest = engine.generate(PROMPTS[1:], GREEDY)
    assert isinstance(first, dict) and isinstance(rest, list)
    assert rest[0]["meta_info"]["cached_tokens"] >= len(PREFIX) - 1  # the radix cache served the prefix
    lp = engine.generate(PROMPTS[1], {**GREEDY, "max_new_tokens": 2, "top_logprobs_num": 2}, logprob_start_len=20)
    assert isinstance(lp, dict)
    return [first["output_ids"], *(o["output_ids"] for o in rest), lp["output_ids"],
            lp["meta_info"]["input_token_logprobs"]]


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_engine_tp2_equals_tp1_on_a_tiny_model(tiny: str, kv_dtype: str) -> None:
    """Also with int8 KV: each rank scales and stores its own heads as one rank stores them all."""
    # small prefill chunks: prompts prefill over several steps, so the journal carries chunk writes
    kw: dict[str, Any] = {"dtype": "float32", "max_total_tokens": 2048, "chunked_prefill_size": 16,
                          "kv_cache_dtype": kv_dtype}
    tp1 = Engine(tiny, **kw)
    want = _run(tp1)
    threads = torch.get_num_threads()
    with Engine(tiny, tp_size=2, **kw) as tp2:
        got = _run(tp2)
        tp2.check_memory_invariant()
        # each rank's KV pool holds its half of the KV heads: half the bytes per token
        assert tp2.runner.kv_pool is not None
        assert tp2.runner.kv_pool.k_buffers[0].shape[1:] == (1, 16)
        assert tp2.runner.kv_pool.format.name == ("int8" if kv_dtype == "int8" else "float32")
        assert tp2.runner.kv_bytes_per_token() * 2 == tp1.runner.kv_bytes_per_token()
        assert tp2.scheduler.kv.total_tokens == tp1.scheduler.kv.total_tokens
        procs = list(tp2._tp_procs)
        assert [p.is_alive() for p in procs] == [True]
    assert got[:-1] == want[:-1]
    assert len(want[-1]) == len(tp1.tokenizer.encode(PROMPTS[1])) - 20 and got[-1] == pytest.approx(want[-1], abs=1e-3)
    assert [p.exitcode for p in procs] == [0]  # the stop message ended rank 1
    assert torch.get_num_threads() == threads  # rank 0's share of the threads was given back


@pytest.mark.slow
def test_bundled_model_tp3_equals_tp1_in_float32(fp32_runner: Any) -> None:
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    want = [o["output_ids"] for o in Engine(runner=fp32_runner, dtype="float32", max_total_tokens=2048)
            .generate(prompts, params)]
    with Engine(None, tp_size=3, dtype="float32", max_total_tokens=2048) as tp3:
        assert tp3.runner.kv_pool is not None and tp3.runner.kv_pool.k_buffers[0].shape[1] == 1  # 3 KV heads / 3
        # each rank keeps its shard's Q4_1 blocks: 3 of 9 heads (192 columns of o_proj), 512 of down_proj's
        assert tp3.runner.quantization == "gguf"
        layer = tp3.runner.model.layers[0]
        assert [s.data.shape for s in layer.self_attn.o_proj._quant.segments] == [(576, 192 // 32 * 20)]
        assert [s.cols for s in layer.mlp.down_proj._quant.segments] == [512]
        got = [o["output_ids"] for o in tp3.generate(prompts, params)]
    assert got == want


@pytest.mark.slow
def test_k_quant_shards_keep_their_blocks(tmp_path: Any) -> None:
    """A random Q4_K_M-mix Llama (scripts/make_random_gguf.py): under tp 2 each rank keeps the Q4_K /
    Q6_K blocks of its shard (o_proj's 256 of 512 columns and down_proj's 512 of 1,024 are whole
    blocks of 256), and computes what tp 1 does."""
    import subprocess
    import sys
    from pathlib import Path

    from radixserve.model.gguf_blocks import GGUFWeight

    model = tmp_path / "k.gguf"
    subprocess.run([sys.executable, "scripts/make_random_gguf.py", str(model), "--hidden", "512", "--layers", "2",
                    "--heads", "4", "--kv-heads", "2", "--ffn", "1024"],
                   check=True, capture_output=True, cwd=Path(__file__).resolve().parents[2], timeout=300)
    kw: dict[str, Any] = {"dtype": "float32", "max_total_tokens": 1024}
    prompt, params = "The quick brown fox jumps over", {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    tp1 = Engine(str(model), **kw)
    want = tp1.generate(prompt, {**params, "top_logprobs_num": 1}, logprob_start_len=0)
    with Engine(str(model), tp_size=2, **kw) as tp2:
        layer = tp2.runner.model.layers[0]
        for linear, cols in ((layer.self_attn.o_proj, 256), (layer.mlp.down_proj, 512)):
            assert isinstance(linear._quant, GGUFWeight) and {s.cols for s in linear._quant.segments} == {cols}
            assert {s.qtype for s in linear._quant.segments} <= {12, 14}  # Q4_K, Q6_K
        got = tp2.generate(prompt, {**params, "top_logprobs_num": 1}, logprob_start_len=0)
    assert isinstance(got, dict) and isinstance(want, dict)
    assert got["output_ids"] == want["output_ids"]
    lp = got["meta_info"]["input_token_logprobs"]
    assert len(lp) > 4 and lp == pytest.approx(want["meta_info"]["input_token_logprobs"], abs=1e-3)


def test_bundled_model_refuses_tp2_before_starting_anything() -> None:
    with pytest.raises(ValueError, match=r"--tp-size 2 does not divide .*num_attention_heads = 9 and "
                                         r"num_key_value_heads = 3.*allows: \[1, 3\]"):
        Engine(None, tp_size=2, dtype="float32")


def test_check_tp_size() -> None:
    cfg = ModelConfig("llama", 2, 64, num_heads=8, num_kv_heads=2, head_dim=8, intermediate_size=100, vocab_size=10)
    check_tp_size(cfg, 2)
    with pytest.raises(ValueError, match="num_key_value_heads = 2"):
        check_tp_size(cfg, 4)


def test_shard_ranges_cover_everything_once() -> None:
    for size in (1, 2, 3):
        ranks = [TPGroup(r, size) for r in range(size)]
        rows = [g.split(151) for g in ranks]
        assert rows[0][0] == 0 and rows[-1][1] == 151
        assert all(a[1] == b[0] for a, b in zip(rows, rows[1:], strict=False))
        vocab = [g.vocab_range(257) for g in ranks]
        assert {v[2] for v in vocab} == {-(-257 // size)}  # every rank holds the same padded rows
        assert vocab[0][0] == 0 and vocab[-1][1] == 257
        assert all(a[1] == b[0] for a, b in zip(vocab, vocab[1:], strict=False))


def test_journal_replay_rebuilds_the_request_table() -> None:
    src = JournaledReqToTokenPool(4, 32)
    dst = ReqToTokenPool(4, 32)
    src.write(1, 0, [5, 6, 7])
    src.write_many([1, 2], [3, 0], [9, 11])
    src.write(3, 4, [])
    replay_journal(dst, torch.tensor(src.take_journal(), dtype=torch.int64))
    assert torch.equal(src.req_to_token, dst.req_to_token)
    assert src.take_journal() == []
    src.write(2, 1, [13])
    replay_journal(dst, torch.tensor(src.take_journal(), dtype=torch.int64))
    assert torch.equal(src.req_to_token, dst.req_to_token)


@pytest.mark.parametrize("kw, message", [
    ({"tp_size": 2, "dp_size": 2}, "--tp-size and --dp-size > 1 together"),
    ({"tp_size": 3, "nnodes": 2, "dist_init_addr": "h:1"}, "multiple of nnodes"),
    ({"tp_size": 2, "nnodes": 2}, "needs --dist-init-addr"),
    ({"tp_size": 2, "nnodes": 2, "node_rank": 2, "dist_init_addr": "h:1"}, "node_rank must be in"),
    ({"tp_size": 2, "dist_init_addr": "nohost"}, "host:port"),
    ({"tp_size": 0}, "tp_size must be a positive integer"),
])
def test_parallelism_options_are_validated(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServerArgs(**kw)


def test_tp_options_are_cli_flags() -> None:
    import argparse

    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    ns = p.parse_args(["--tp-size", "2", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "10.0.0.1:5000"])
    args = ServerArgs.from_cli_args(ns)
    assert (args.tp_size, args.nnodes, args.node_rank, args.dist_init_addr) == (2, 2, 1, "10.0.0.1:5000")
    assert args.tp_ranks_per_node == 1


class _Wire:
    """Rank 0's broadcasts, replayed into the buffers another rank passes (one process)."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.sent: list[torch.Tensor] = []
        self.sending = True

    def broadcast_(self, t: torch.Tensor) -> torch.Tensor:
        if self.sending:
            self.sent.append(t.clone())
            return t
        return t.copy_(self.sent.pop(0))


def test_step_message_carries_verify_rows_and_draft_trees() -> None:
    """What the other ranks attend by: the verify rows and, where drafts branch, every verify
    row's parents (a chain row's too), cut apart again by the rows' extend lengths."""
    t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    fb = ForwardBatch(t([5, 1, 2, 3, 9, 4, 6]), t([10, 20, 21, 21, 7, 8, 9]), t([11, 12, 13, 14, 15, 16, 17]),
                      t([0, 1, 2]), t([11, 24, 10]), [10, 20, 7], [1, 4, 2], SamplingBatchInfo.greedy(3),
                      verify=VerifyRows([1, 2], [[1, 2, 3], [4]], [1, 2, 3, 5], parents=[[-1, -1, 1], [-1]]))
    wire = _Wire()
    send_step(wire, fb, [7, 8])  # type: ignore[arg-type]
    wire.sending = False
    got = recv_step(wire)  # type: ignore[arg-type]
    assert got is not None
    other, journal = got
    assert journal.tolist() == [7, 8] and torch.equal(other.positions, fb.positions)
    assert other.verify is not None and other.verify.rows == [1, 2]
    assert other.verify.parents == [[-1, -1, 1], [-1]]
    assert other.extra_logit_positions() == [1, 2, 3, 5]


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["ngram", "draft"])
def test_engine_tp2_speculation_equals_tp1_plain(tiny: str, algorithm: str) -> None:
    """Drafts verified across two ranks (the verify rows and their logits positions travel with the
    step) give what one rank decoding plainly gives. n-gram drafts; or a draft model, which runs
    whole on rank 0 before the step is sent (here the target's own file: its drafts are the
    target's tokens) and writes its drafts into the step's input ids."""
    kw: dict[str, Any] = {"dtype": "float32", "max_total_tokens": 2048}
    prompt = "one two three four " * 6
    plain = Engine(tiny, **kw).generate(prompt, GREEDY)
    with Engine(tiny, tp_size=2, speculative_algorithm=algorithm, **kw) as tp2:
        spec = tp2.scheduler.parts.spec
        assert spec is not None
        spec.costs.seconds = {n: 0.02 + 0.002 * n for n in range(1, 200)}  # draft whatever this machine's load
        spec.observe = lambda tokens, seconds: None  # type: ignore[method-assign]
        got = tp2.generate(prompt, GREEDY)
        tp2.check_memory_invariant()
    assert isinstance(plain, dict) and isinstance(got, dict)
    assert got["meta_info"]["spec_verify_ct"] > 0
    assert got["output_ids"] == plain["output_ids"]
    if algorithm == "draft":
        assert got["meta_info"]["spec_accept_length"] > 2
