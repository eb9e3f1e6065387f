"""GGUF weights read in their blocks: the kernel against the dequantized matrix for every type and
both of its paths, the row operations loading does, and whole models (the bundled SmolLM2, and a
tiny Llama whose matrices are K-quant blocks mixed as in a Q4_K_M file) against the same files
expanded to float."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from radixserve.model.dequant import block_types
from radixserve.model.gguf_blocks import GGUFBlocks, GGUFWeight, cat_rows
from tests.model.test_dequant import BLOCK_TYPES, F16_FIELDS, random_blocks

pytestmark = pytest.mark.skipif(not block_types(), reason="the GGUF block kernels did not build here")


def sane_blocks(name: str, rows: int, cols: int, seed: int = 0, scale: float = 1e-3) -> np.ndarray:
    """Random blocks of ``name`` whose float16 scales are small (values of a weight matrix's size)."""
    qtype = GGMLQuantizationType[name]
    block = GGML_QUANT_SIZES[qtype][0]
    raw = random_blocks(name, rows, cols // block, seed).reshape(rows * cols // block, -1)
    rng = np.random.default_rng(seed + 1)
    for off in F16_FIELDS[name]:
        raw[:, off : off + 2] = (rng.standard_normal(len(raw)) * scale).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def blocks_of(name: str, rows: int, cols: int, seed: int = 0) -> GGUFBlocks:
    return GGUFBlocks(torch.from_numpy(sane_blocks(name, rows, cols, seed)), int(GGMLQuantizationType[name]), cols)


@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_linear_equals_the_dequantized_matmul_on_both_paths(name: str) -> None:
    b = blocks_of(name, rows=41, cols=512)  # an odd count: the last weight row has no pair
    w = b.dequantize()
    assert w.shape == (41, 512) and torch.isfinite(w).all()
    for rows in (1, 3, 4, 7, 9, 33):  # up to 8: row by row; past it: tiles through the GEMM
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
        got = GGUFWeight([b], small_rows=8)(x)
        want = x.double() @ w.double().t()
        assert got.dtype == torch.float32 and got.shape == (rows, 41)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    xb = torch.randn(2, 512).to(torch.bfloat16)  # a bfloat16 model's activations come back in bfloat16
    assert GGUFWeight([b], small_rows=8)(xb).dtype == torch.bfloat16


def test_lookup_and_row_operations_keep_the_blocks_exact() -> None:
    b = blocks_of("Q4_K", rows=12, cols=256)
    w = b.dequantize()
    ids = torch.tensor([3, 0, 11, 3])
    assert torch.equal(b.lookup(ids), w[ids])
    q, k = b.split([8, 4])
    assert torch.equal(q.dequantize(), w[:8]) and torch.equal(k.dequantize(), w[8:])
    assert torch.equal(b.chunk(2)[1].dequantize(), w[6:])
    assert b[:, 0:256].data is not None and torch.equal(b[2:5].dequantize(), w[2:5])
    with pytest.raises(ValueError, match="columns 0:128"):
        b[:, 0:128]  # inside a block of 256
    wide = blocks_of("Q4_K", rows=6, cols=768)
    shard = wide[1:4, 256:768]  # a tensor-parallel shard of a row-parallel linear: whole blocks
    assert shard.shape == (3, 512) and torch.equal(shard.dequantize(), wide.dequantize()[1:4, 256:768])
    small = blocks_of("Q4_1", rows=4, cols=256)
    assert torch.equal(small[:, 192:256].dequantize(), small.dequantize()[:, 192:256])  # blocks of 32
    with pytest.raises(IndexError):
        b.lookup(torch.tensor([12]))
    stacked = GGUFBlocks(b.data.reshape(3, 4, -1), b.qtype, 256)  # [experts, rows, cols]
    assert stacked.shape == (3, 4, 256) and torch.equal(stacked[1].dequantize(), w[4:8])


def test_a_fused_weight_of_mixed_types_keeps_one_segment_per_type() -> None:
    """Q4_K_M files keep some v (and down) projections in Q6_K: q/k/v fused is Q4_K, Q4_K, Q6_K."""
    q, k, v = blocks_of("Q4_K", 8, 256, 1), blocks_of("Q4_K", 4, 256, 2), blocks_of("Q6_K", 4, 256, 3)
    segments = cat_rows([q, k, v])
    assert isinstance(segments, list) and [s.qtype for s in segments] == [q.qtype, v.qtype]
    weight = GGUFWeight(segments, small_rows=8)
    dense = torch.cat([q.dequantize(), k.dequantize(), v.dequantize()])
    assert torch.equal(weight.dequantize(), dense)
    for rows in (1, 12):
        x = torch.randn(rows, 256)
        torch.testing.assert_close(weight(x), x @ dense.t(), rtol=1e-4, atol=1e-4)
    # a float part makes the whole fused weight float
    mixed = cat_rows([q, torch.zeros(4, 256)])
    assert isinstance(mixed, torch.Tensor) and torch.equal(mixed[:8], q.dequantize())


def test_a_linear_keeps_blocks_instead_of_a_float_weight() -> None:
    from radixserve.model.linear import Linear

    lin = Linear(256, 12, bias=True, dtype=torch.float32)
    with torch.no_grad():
        lin.bias.copy_(torch.randn(12))  # type: ignore[union-attr]
    b = blocks_of("Q5_K", 12, 256)
    lin.load([b[:5], b[5:]], small_rows=4)
    assert lin.in_blocks and lin.weight.numel() == 0 and not lin.pack()
    for rows in (2, 6):  # both kernel paths, bias added
        x = torch.randn(rows, 256)
        torch.testing.assert_close(lin(x), x @ b.dequantize().t() + lin.bias, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="12x256"):
        Linear(256, 8, bias=False, dtype=torch.float32).load([b])


def test_quantization_auto_keeps_a_gguf_models_blocks(tmp_path: Any) -> None:
    from radixserve.model.run_options import resolve_quantization

    assert resolve_quantization("auto", None) == "gguf"  # also under tensor parallelism: shards keep blocks
    assert resolve_quantization("int4", None) == "int4"
    st = tmp_path / "m"
    st.mkdir()
    (st / "config.json").write_text("{}")
    assert resolve_quantization("auto", str(st)) == "none"  # not a GGUF
    with pytest.raises(ValueError, match="GGUF"):
        resolve_quantization("gguf", str(st))


def test_the_bundled_model_is_read_in_place(fp32_runner: Any) -> None:
    """Every linear in its file blocks (Q4_1, the Q8_0 embedding as the tied head), weights within
    1.15x of the file's tensor bytes, no float matrix anywhere."""
    from radixserve.model.gguf_loader import gguf_tensor_bytes
    from radixserve.model.linear import Linear
    from radixserve.model.loader import default_model_path

    r = fp32_runner
    assert r.quantization == "gguf"
    linears = [m for m in r.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.in_blocks and m.weight.numel() == 0 for m in linears)
    assert r.block_types() == ["Q4_1 x120", "Q8_0 x1"]
    assert r.model.embed_tokens.numel() == 0 and r.model.embed_blocks is not None
    assert r.quant_max_rows == 64 and r.model.lm_head._quant.small_rows == 64  # float32's row/tile crossover
    file_bytes = gguf_tensor_bytes(default_model_path())
    assert r.model.weight_bytes() <= 1.15 * file_bytes
    assert r.model.weight_bytes() >= 0.9 * file_bytes  # counted, not missed


def _tiny_q4_k_m(directory: str, down_type: str = "Q6_K") -> str:
    """A tiny Llama (hidden 256: K-quant blocks are 256 wide) stored as a Q4_K_M file is: Q4_K
    matrices, v and down projections and the output in Q6_K, the embedding in Q8_0 (random blocks
    with small scales: the kernels' layout is what is under test, not a quantizer)."""
    from tests.model.tiny_llama import make_tiny_llama
    from tests.model.tiny_models import write_gguf

    hf = make_tiny_llama(os.path.join(directory, "hf"), hidden=256, heads=4, kv_heads=2, intermediate=512)
    seeds = iter(range(1000))

    def blocks(name: str, arr: np.ndarray) -> tuple[np.ndarray, GGMLQuantizationType] | None:
        kind = "Q8_0" if name == "token_embd.weight" else down_type if name.endswith("ffn_down.weight") else \
            "Q6_K" if name == "output.weight" or name.endswith("attn_v.weight") else "Q4_K"
        rows, cols = arr.reshape(-1, arr.shape[-1]).shape
        scale = 3e-3 if kind == "Q8_0" else 2e-4
        if kind == "TQ2_0":  # ternary blocks of 256: 64 bytes of 2-bit values, a float16 scale
            rng = np.random.default_rng(next(seeds))
            raw = rng.integers(0, 256, size=(rows * cols // 256, 66), dtype=np.uint8)
            raw[:, 64:] = (rng.standard_normal(len(raw)) * 0.02).astype(np.float16).view(np.uint8).reshape(-1, 2)
            return raw.reshape(*arr.shape[:-1], -1), GGMLQuantizationType.TQ2_0
        raw = sane_blocks(kind, rows, cols, seed=next(seeds), scale=scale)
        return raw.reshape(*arr.shape[:-1], -1), GGMLQuantizationType[kind]

    return write_gguf(hf, os.path.join(directory, "tiny-q4_k_m.gguf"), blocks=blocks)


def test_a_q4_k_m_model_in_place_matches_it_expanded(tmp_path: Any) -> None:
    from radixserve.engine import Engine

    path = _tiny_q4_k_m(str(tmp_path))
    prompts = ["hello there, blocks", "a" * 40]
    outs = {}
    for q in ("gguf", "none"):
        e = Engine(model_path=path, quantization=q, dtype="float32", mem_fraction_static=0.01, log_level="error")
        try:
            if q == "gguf":
                runner = e.runner  # type: ignore[attr-defined]
                assert runner.block_types() == ["Q4_K x6", "Q6_K x5"]  # q/k/v: Q4_K + Q6_K segments
            outs[q] = e.generate(prompts, {"temperature": 0, "max_new_tokens": 12, "logprobs": True})
        finally:
            e.shutdown()
    for a, b in zip(outs["gguf"], outs["none"], strict=True):
        assert a["output_ids"] == b["output_ids"]
        la, lb = a["meta_info"]["output_token_logprobs"], b["meta_info"]["output_token_logprobs"]
        np.testing.assert_allclose(la, lb, rtol=1e-4, atol=1e-4)


def test_a_type_without_a_block_kernel_is_expanded_at_load_and_said(tmp_path: Any,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    from radixserve.model.gguf_loader import load_gguf

    path = _tiny_q4_k_m(str(tmp_path), down_type="TQ2_0")
    with caplog.at_level("WARNING", logger="radixserve.model.gguf_loader"):
        _, state = load_gguf(path, progress=False, keep_blocks=True)
    assert "no block kernel here for TQ2_0" in caplog.text
    down = state["model.layers.0.mlp.down_proj.weight"]
    assert isinstance(down, torch.Tensor) and down.shape == (256, 512) and torch.isfinite(down).all()
    assert isinstance(state["model.layers.0.mlp.up_proj.weight"], GGUFBlocks)

