"""Verifying drafted tokens computes, bit for bit, what decoding them one at a time computes: the
block kernel sums every output row in one order whatever the number of rows, the paged attention
kernel cuts a row by its length alone, and a verify row's positions are attended as the decode rows
they would have been. So greedy speculation is exact, not exact up to a near-tie."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kvharness import Harness

from radixserve.mem.forward_batch import ForwardBatch, VerifyRows
from radixserve.model.dequant import has_bf16_kernel, linear_ext, vnni_ext
from radixserve.model.gguf_file import open_gguf
from radixserve.model.loader import default_model_path
from radixserve.model.model_runner import ModelRunner
from radixserve.model.paged_attention import paged_decode_attention


def block_weights() -> list[tuple[str, torch.Tensor, int, int]]:
    """One weight of each block type in the bundled model, and a float16 one (no fused expander:
    the dequantize-then-dot path)."""
    seen: dict[int, tuple[str, torch.Tensor, int, int]] = {}
    for t in open_gguf(default_model_path()).tensors:
        if len(t.shape) == 2 and t.data.dtype == np.uint8 and int(t.tensor_type) not in seen:
            seen[int(t.tensor_type)] = (t.name, torch.from_numpy(np.array(t.data)), int(t.tensor_type), t.shape[0])
    f16 = torch.randn(96, 576, generator=torch.Generator().manual_seed(1)).half()
    return [*seen.values(), ("f16", f16.view(torch.uint8).reshape(96, -1), 1, 576)]


@pytest.mark.parametrize("weight", block_weights(), ids=lambda w: w[0])
def test_block_kernel_rows_do_not_depend_on_the_batch(weight: tuple[str, torch.Tensor, int, int]) -> None:
    _, w, qtype, k = weight
    ext = linear_ext()
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(0))
    alone = torch.cat([ext.linear(x[i : i + 1], w, qtype, 64) for i in range(40)])
    for m in (2, 3, 4, 5, 8, 9, 13, 17, 40):
        assert torch.equal(ext.linear(x[:m], w, qtype, 64), alone[:m]), f"{m} rows"


@pytest.mark.skipif(vnni_ext() is None, reason="no AVX512-VNNI on this CPU")
@pytest.mark.parametrize("weight", block_weights()[:-1], ids=lambda w: w[0])
def test_vnni_kernel_rows_do_not_depend_on_the_batch(weight: tuple[str, torch.Tensor, int, int]) -> None:
    """The integer kernel a bfloat16 model's decode and verify rows take: rows in chunks of up to 8
    unpacked straight into the products, or (past 24) from a buffered weight row, alike."""
    _, w, qtype, k = weight
    ext = vnni_ext()
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(0)).bfloat16()
    alone = torch.cat([ext.linear(x[i : i + 1], w, qtype) for i in range(40)])
    for m in (2, 4, 5, 8, 9, 16, 17, 24, 25, 40):
        assert torch.equal(ext.linear(x[:m], w, qtype), alone[:m]), f"{m} rows"


@pytest.mark.parametrize("length", [1, 100, 129, 300, 1000, 3000])
def test_paged_attention_row_does_not_depend_on_the_batch(length: int) -> None:
    g = torch.Generator().manual_seed(length)
    slots, kvh, d, h = 8192, 3, 64, 9
    k, v = torch.randn(slots, kvh, d, generator=g), torch.randn(slots, kvh, d, generator=g)
    lens = torch.tensor([length, 2000, 64, 700, length + 1])
    r2t = torch.randint(1, slots, (5, 3001), generator=g)
    q = torch.randn(5, h, d, generator=g)
    rpi = torch.arange(5)
    full = paged_decode_attention(q, k, v, r2t, rpi, lens, 0.125)
    for b in (0, 4):
        alone = paged_decode_attention(q[b : b + 1], k, v, r2t, rpi[b : b + 1], lens[b : b + 1], 0.125)
        assert torch.equal(alone[0], full[b])


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def runner(request: pytest.FixtureRequest) -> ModelRunner:
    if request.param == "bfloat16" and not has_bf16_kernel():
        pytest.skip("bfloat16 decode rows past a few take oneDNN's GEMM here (no AVX512-BF16)")
    r = ModelRunner(None, dtype=request.param, attention_backend="cpu_paged", progress=False)
    r.attach_pools(r.make_kv_pool(4096, page_size=16), r.make_req_to_token_pool(8))
    return r


def run(runner: ModelRunner, fb: ForwardBatch) -> torch.Tensor:
    assert runner.kv_pool is not None and runner.req_to_token_pool is not None
    with torch.inference_mode():
        return runner.model(fb, runner.kv_pool, runner.req_to_token_pool).float()


def test_verify_logits_equal_decode_logits(runner: ModelRunner) -> None:
    assert runner.kv_pool is not None and runner.req_to_token_pool is not None
    h = Harness(runner.kv_pool, runner.req_to_token_pool)
    prompt = torch.randint(0, 1000, (150,), generator=torch.Generator().manual_seed(3)).tolist()
    other = torch.randint(0, 1000, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    drafts = [17, 942, 5, 300, 77, 1001, 12]
    # the request decoded token by token, next to another request decoding
    a, b = h.new_request(), h.new_request()
    run(runner, h.batch([a, b], [prompt, other]))
    step: list[torch.Tensor] = []
    for t in drafts:
        step.append(run(runner, h.batch([a, b], [[t], [5]]))[0])
    # the same request (prefilled again) verifying all of them in one step, beside a decode row
    c, d = h.new_request(), h.new_request()
    run(runner, h.batch([c, d], [prompt, other]))
    fb = h.batch([d, c], [[5], drafts])
    start = 1  # c's tokens follow d's one
    fb.verify = VerifyRows([1], [drafts[1:]], [start + j for j in range(len(drafts) - 1)])
    out = run(runner, fb)
    verified = torch.cat([out[2:], out[1:2]])  # extra positions first, then c's last position
    assert torch.equal(verified, torch.stack(step))
    for r in (a, b, c, d):
        h.free_request(r)


def test_tree_verify_logits_equal_each_paths_decode_logits(runner: ModelRunner) -> None:
    """Drafts as a tree (two branches from the last token, each two or three deep, beside a plain
    decode row): every node's logits are, bit for bit, those of decoding its own path."""
    assert runner.kv_pool is not None and runner.req_to_token_pool is not None
    h = Harness(runner.kv_pool, runner.req_to_token_pool)
    prompt = torch.randint(0, 1000, (120,), generator=torch.Generator().manual_seed(5)).tolist()
    other = torch.randint(0, 1000, (30,), generator=torch.Generator().manual_seed(6)).tolist()
    last, branch_a, branch_b = 17, [942, 5, 300], [61, 8]
    decoded: dict[int, torch.Tensor] = {}  # token -> logits after it, along its branch

    for branch in (branch_a, branch_b):
        a, b = h.new_request(), h.new_request()
        run(runner, h.batch([a, b], [prompt, other]))
        decoded[-1] = run(runner, h.batch([a, b], [[last], [5]]))[0]
        for t in branch:
            decoded[t] = run(runner, h.batch([a, b], [[t], [5]]))[0]
        for r in (a, b):
            h.free_request(r)
    # the tree: 942, 61 under the last token; 5 under 942; 8 under 61; 300 under 5
    drafts, parents = [942, 61, 5, 8, 300], [-1, -1, 0, 1, 2]
    c, d = h.new_request(), h.new_request()
    run(runner, h.batch([c, d], [prompt, other]))
    fb = h.batch([d, c], [[5], [last, *drafts]])
    p = len(prompt)
    fb.positions = torch.tensor([len(other), p, p + 1, p + 1, p + 2, p + 2, p + 3])
    fb.verify = VerifyRows([1], [drafts], [1, 2, 3, 4, 5], parents=[parents])
    out = run(runner, fb)
    # rows: d's last, c's last (its final draft, 300), then c's positions before it: last, 942, 61, 5, 8
    got = dict(zip([-1, *drafts[:-1]], out[2:], strict=True))
    got[300] = out[1]
    for t, logits in decoded.items():
        assert torch.equal(got[t], logits), t
    for r in (c, d):
        h.free_request(r)
