"""``radixserve bench model``: the llama-server command line it builds, and a small real run of
radixserve alone (a real server started and stopped by the benchmark) checked through its JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from radixserve.bench.model_bench import _commands, add_args, main


def _ns(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_args(p)
    return p.parse_args(list(argv))


def test_llama_server_gets_a_slot_per_concurrent_request_and_their_context() -> None:
    ns = _ns("--llama-server", "/opt/llama-server", "--threads", "2", "--concurrency", "8", "--input-len", "100",
             "--output-len", "20", "--llama-args=--no-warmup")
    cmds = _commands(ns, "/m.gguf", 1234)
    llama = cmds["llama-server"]
    assert llama[:3] == ["/opt/llama-server", "-m", "/m.gguf"]
    assert llama[llama.index("-np") + 1] == "8" and llama[llama.index("-c") + 1] == str(8 * 136)
    assert llama[-1] == "--no-warmup" and "--num-threads" in cmds["radixserve"]
    ours = cmds["radixserve"]
    assert ours[ours.index("--max-total-tokens") + 1] == str(8 * 136)  # the same KV capacity
    assert set(_commands(_ns(), "/m.gguf", 1)) == {"radixserve"}  # no binary: radixserve alone


def test_a_missing_model_or_binary_is_one_line_and_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_ns("--model-path", str(tmp_path / "none.gguf"))) == 1
    assert capsys.readouterr().err.strip() == f"error: model path does not exist: {tmp_path / 'none.gguf'}"
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    assert main(_ns("--model-path", str(model), "--llama-server", str(tmp_path / "llama-server"))) == 1
    assert "is not an executable file" in capsys.readouterr().err


@pytest.mark.slow  # starts a real server
def test_bench_model_measures_a_real_server(tmp_path: Path) -> None:
    from radixserve.cli import main

    out = tmp_path / "model.json"
    code = main(["bench", "model", "--rounds", "1", "--input-len", "16", "--output-len", "4", "--single-prompts",
                 "2", "--concurrency", "2", "--concurrent-prompts", "2",
                 "--server-args=--max-running-requests 4", "--output", str(out)])
    assert code == 0
    rep = json.loads(out.read_text())
    m = rep["medians"]["radixserve"]
    assert set(rep["medians"]) == {"radixserve"} and len(rep["rounds"]["radixserve"]) == 1
    assert 0 < m["healthy_s"] < 600 and m["rss_mb"] > 50 and m["tpot_p50_ms"] > 0
    assert m["concurrent_output_tok_s"] > 0 and rep["output_len"] == 4


@pytest.mark.parametrize("arch", ["llama", "qwen3moe"])
def test_make_random_gguf_writes_a_model_radixserve_reads_in_its_blocks(tmp_path: Path, arch: str) -> None:
    """scripts/make_random_gguf.py (the ~1B and MoE benchmark models) at a tiny size: the config is
    what was asked, the mix is Q4_K_M's, and the file loads in place."""
    import subprocess
    import sys

    from radixserve.model.gguf_blocks import GGUFBlocks
    from radixserve.model.gguf_loader import load_gguf
    from radixserve.model.loader import load_config

    out = tmp_path / "m.gguf"
    subprocess.run([sys.executable, "scripts/make_random_gguf.py", str(out), "--arch", arch, "--hidden", "256",
                    "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn", "512", "--experts", "4"],
                   check=True, capture_output=True, cwd=Path(__file__).resolve().parents[1], timeout=300)
    c = load_config(str(out))
    assert (c.arch, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == (arch, 2, 256, 4, 2)
    assert c.num_experts == (4 if arch == "qwen3moe" else 0) and c.tie_word_embeddings
    _, state = load_gguf(str(out), progress=False, keep_blocks=True)
    kinds = {k: v.qtype for k, v in state.items() if isinstance(v, GGUFBlocks)}
    assert {12, 14, 8} <= set(kinds.values())  # Q4_K, Q6_K, Q8_0
