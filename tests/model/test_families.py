"""Every model family besides Llama (Mixtral, Qwen3-MoE, Phi-3 with partial rotary and LongRoPE,
Granite's scalars, OLMo 2's output norms):
float32 logits and greedy tokens equal to transformers' own model of the same checkpoint, loaded
from the HF directory and from the same weights as a GGUF file; the context limit of a
sliding-window model; experts under tensor parallelism."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from kvharness import Harness

from radixserve.config import ServerArgs
from radixserve.engine import Engine
from radixserve.model.config import ModelConfig
from radixserve.model.model_runner import ModelRunner
from radixserve.model.run_options import windowed
from radixserve.serving_build import local_window
from tests.model.tiny_models import FAMILIES, make_tiny_model, write_gguf

transformers = pytest.importorskip("transformers")

REL_TOL = 1e-5  # float32 against float32: rounding only (the reductions run in another order)


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, Any]:
    """(family, checkpoint directory, transformers' model of it)."""
    d = make_tiny_model(str(tmp_path_factory.mktemp(request.param)), request.param)
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    return request.param, d, hf


def runner_and_harness(path: str, context_length: int | None = None,
                       backend: str = "torch_native") -> tuple[ModelRunner, Harness]:
    r = ModelRunner(path, dtype="float32", attention_backend=backend, progress=False, context_length=context_length)
    kv = r.make_kv_pool(4096, page_size=16)
    r2t = r.make_req_to_token_pool(8)
    r.attach_pools(kv, r2t)
    return r, Harness(kv, r2t)


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def hf_logits(hf: Any, tokens: list[int]) -> torch.Tensor:
    return hf(torch.tensor([tokens])).logits[0, -1]


# the paged kernel runs the C++ small ops (each layer's residual add folded into the next norm),
# torch_native the reference ops (each layer as transformers writes it)
@pytest.mark.parametrize("fmt, backend", [("hf", "cpu_paged"), ("gguf", "cpu_paged"), ("hf", "torch_native")])
def test_prefill_extend_and_decode_match_transformers(
    family: tuple[str, str, Any], fmt: str, backend: str, tmp_path: Any
) -> None:
    name, d, hf = family
    path = d if fmt == "hf" else write_gguf(d, str(tmp_path / "model.gguf"))
    # Phi-3: a context within the original 128 positions runs LongRoPE's short factors, as
    # transformers does for a sequence that fits them
    if name == "gemma2" and backend == "cpu_paged":
        # the paged kernel has no score capping: refused by name, and auto gives Gemma 2 the torch path
        with pytest.raises(ValueError, match="no score soft-capping"):
            ModelRunner(path, dtype="float32", attention_backend="cpu_paged", progress=False)
        backend = "auto"
    runner, h = runner_and_harness(path, context_length=128 if name == "phi3" else None, backend=backend)
    if name in ("gemma3", "mistral") and backend == "cpu_paged":  # windowed layers on the kernel too
        local = runner.model.local_attn_backend  # (Mistral: every layer, its context being past the window)
        assert type(local).__name__ == "CpuPagedAttention" and local.window == 8
    cfg = runner.model_config
    assert cfg.num_experts == {"mixtral": 4, "qwen3_moe": 6}.get(name, 0)
    if name == "granite":
        assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.logits_scaling) == (3.0, 0.5, 4.0)
        assert cfg.attention_multiplier == pytest.approx(0.2)
    if name == "olmo2":
        assert cfg.norm_layout == "post" and cfg.qk_norm_whole
    if name == "qwen3_moe":
        assert cfg.dense_layers == (1,) and not cfg.norm_topk_prob and cfg.qk_norm
    if name == "phi3":
        assert cfg.rotary_dim == 12 and cfg.rope_scaling is not None
    if name.startswith("gemma"):
        assert cfg.sliding_window == 8 and cfg.sliding_layers == (0,) and cfg.norm_layout == "sandwich"
        assert runner.model.local_attn_backend is not None and runner.model.local_attn_backend.window == 8
    # a batch of prompts of different lengths, one of them a single token (past Gemma's window of 8)
    prompts = [ids(n, seed=n) for n in (1, 9, 60)]
    reqs = [h.new_request() for _ in prompts]
    out = runner.forward(h.batch(reqs, prompts)).logits
    for i, p in enumerate(prompts):
        assert rel_err(out[i], hf_logits(hf, p)) < REL_TOL
    # greedy decode, all three at once, every step against transformers' full recompute
    seqs = [list(p) for p in prompts]
    last = out.argmax(-1).tolist()
    for _ in range(6):
        for s, t in zip(seqs, last, strict=True):
            s.append(t)
        out = runner.forward(h.batch(reqs, [[t] for t in last])).logits
        for i, s in enumerate(seqs):
            ref = hf_logits(hf, s)
            assert rel_err(out[i], ref) < REL_TOL
            assert int(out[i].argmax()) == int(ref.argmax())
        last = out.argmax(-1).tolist()
    # a new request sharing the longest one's first 40 tokens from its KV slots (a cache hit)
    fork = h.fork(reqs[2], 40)
    rest = seqs[2][40:50]
    assert rel_err(runner.forward(h.batch([fork], [rest])).logits[0], hf_logits(hf, seqs[2][:50])) < REL_TOL


def test_gguf_and_hf_checkpoints_load_the_same_model(family: tuple[str, str, Any], tmp_path: Any) -> None:
    from radixserve.model.loader import load_model

    _, d, _ = family
    path = write_gguf(d, str(tmp_path / "model.gguf"))
    hf_cfg, hf_sd = load_model(d, progress=False)
    g_cfg, g_sd = load_model(path, progress=False)
    for field in ("arch", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                  "dense_layers", "rotary_dim", "qk_norm", "tie_word_embeddings", "norm_layout", "qk_norm_whole",
                  "hidden_act", "sliding_window", "sliding_layers", "local_rope_theta"):
        assert getattr(g_cfg, field) == getattr(hf_cfg, field), field
    for field in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling",
                  "attn_softcap", "final_softcap", "rope_theta"):
        want = getattr(hf_cfg, field)
        assert getattr(g_cfg, field) == (None if want is None else pytest.approx(want, rel=1e-7)), field
    g_rope, hf_rope = g_cfg.rope_scaling or {}, hf_cfg.rope_scaling or {}
    assert sorted(g_rope) == sorted(hf_rope)
    for key, value in hf_rope.items():  # GGUF holds the factors as float32
        assert g_rope[key] == (value if isinstance(value, str) else pytest.approx(value, rel=1e-7)), key
    assert sorted(g_sd) == sorted(hf_sd)
    for k in hf_sd:  # llama.cpp's Gemma files hold each norm weight plus its offset from 1
        offset = hf_cfg.norm_weight_offset - g_cfg.norm_weight_offset if k.endswith("norm.weight") else 0
        assert torch.equal(g_sd[k], hf_sd[k] + offset), k
    # the same file with its matrices in Q8_0 blocks: read in place, the same model as expanded
    qpath = write_gguf(d, str(tmp_path / "q8.gguf"), blocks=_q8_0)
    seq = ids(30, seed=5)
    logits = {}
    for q in ("gguf", "none"):
        r = ModelRunner(qpath, dtype="float32", progress=False, quantization=q, context_length=128)
        kv, r2t = r.make_kv_pool(1024, page_size=16), r.make_req_to_token_pool(4)
        r.attach_pools(kv, r2t)
        h = Harness(kv, r2t)
        logits[q] = r.forward(h.batch([h.new_request()], [seq])).logits[0]
        if q == "gguf":  # every linear whose input size holds whole blocks (Mixtral's 48-wide down is float)
            want = [m.in_features % 32 == 0 for m in r.model.linear_sources()]
            assert [m.in_blocks for m in r.model.linear_sources()] == want and any(want)
    assert rel_err(logits["gguf"], logits["none"]) < REL_TOL


def _q8_0(name: str, arr: Any) -> Any:
    """``write_gguf``'s ``blocks``: every matrix whose rows hold whole blocks, in Q8_0."""
    from gguf import GGMLQuantizationType, quants

    if arr.shape[-1] % 32:
        return None
    return quants.quantize(arr, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0


def test_phi3_long_context_uses_the_long_factors(family: tuple[str, str, Any]) -> None:
    name, d, hf = family
    if name != "phi3":
        pytest.skip("LongRoPE is Phi-3's")
    # a 512-token context picks the long factors; transformers does for a sequence past 128
    runner, h = runner_and_harness(d, context_length=512)
    long = ids(200, seed=3)
    r = h.new_request()
    assert rel_err(runner.forward(h.batch([r], [long])).logits[0], hf_logits(hf, long)) < REL_TOL
    short_runner, h2 = runner_and_harness(d, context_length=128)
    assert not torch.equal(runner.model.cos_cache[:10], short_runner.model.cos_cache[:10])


def test_engine_serves_each_family_greedy_as_transformers(family: tuple[str, str, Any]) -> None:
    """Through the scheduler: chunked prefill, batched decode, the radix cache; nothing leaks."""
    name, d, hf = family
    ctx = 128 if name == "phi3" else None
    with Engine(d, dtype="float32", max_total_tokens=2048, chunked_prefill_size=16, context_length=ctx) as eng:
        prompts = ["the same opening words, then one", "the same opening words, then two", "x"]
        _greedy_as_transformers(eng, hf, prompts, 8)
        eng.check_memory_invariant()


def _greedy_as_transformers(eng: Engine, hf: Any, prompts: list[str], n: int) -> list[dict[str, Any]]:
    """The engine's greedy ``n`` tokens of each prompt are transformers' own; returns its outputs."""
    outs = eng.generate(prompts, {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True})
    assert isinstance(outs, list)
    for prompt, o in zip(prompts, outs, strict=True):
        tokens = eng.tokenizer.encode(prompt)
        with torch.inference_mode():
            want = hf.generate(torch.tensor([tokens]), max_new_tokens=n, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(tokens):].tolist()
        assert o["output_ids"] == want
    return outs


def test_a_whole_model_window_frees_kv_behind_it_through_the_engine(tmp_path: Any) -> None:
    """Mistral (window 8 on every layer) generating far past its window: the scheduler frees each
    request's KV behind the window as it goes (the paged kernel never reads it), the tokens are
    transformers' own, and every slot comes back."""
    d = make_tiny_model(str(tmp_path), "mistral")
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with Engine(d, dtype="float32", max_total_tokens=2048) as eng:
        kv = eng.scheduler.kv
        assert kv.window == 8
        freed: list[int] = []
        real = kv.windows.before_grow

        def spy(req: Any) -> None:
            before = req.kv_freed_to
            real(req)
            freed.append(req.kv_freed_to - before)

        kv.windows.before_grow = spy  # type: ignore[method-assign]
        _greedy_as_transformers(eng, hf, ["a short one", "another prompt, a little longer"], 40)
        assert sum(freed) >= 2 * 30
        eng.check_memory_invariant()


@pytest.mark.parametrize("page", [1, 4])
def test_sliding_layers_keep_only_windows_in_slots_of_their_own(tmp_path: Any, page: int) -> None:
    """Gemma 3 (a sliding layer with a window of 8, a global one) generating far past its window,
    in chunks of 16, then again with prefix hits (the same prompts, and prompts leaving them
    after or before their end): every token is transformers' own, the sliding layer's pages behind each window and
    inside each cached stretch are given back while the global layer keeps every position, and
    every page comes back."""
    d = make_tiny_model(str(tmp_path), "gemma3")
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with Engine(d, dtype="float32", max_total_tokens=2048, page_size=page, chunked_prefill_size=16) as eng:
        kv = eng.scheduler.kv
        wkv = kv.window_kv
        assert wkv is not None and wkv.window == 8 and kv.window is None
        first = ["a short one", "another prompt, a little longer than the window of eight tokens"]
        _greedy_as_transformers(eng, hf, first, 40)
        eng.check_memory_invariant()
        cached = kv.evictable_size()
        assert cached > 100 and wkv.used_pages() * page < cached / 2
        # the same prompts, one going on from its prompt, one leaving it where its sliding layer's
        # pages were given back (its prefix hit stops where the window before it is whole)
        again = first + [first[1] + " and on, past it", first[1][:40] + " and then elsewhere"]
        outs = _greedy_as_transformers(eng, hf, again, 30)
        assert all(o["meta_info"]["cached_tokens"] > 0 for o in outs)
        assert outs[3]["meta_info"]["cached_tokens"] < 40
        eng.check_memory_invariant()


def test_sliding_layers_have_slots_of_their_own_only_where_no_kv_moves_by_slot(tmp_path: Any) -> None:
    """Gemma's local layers get their own slots by default; not with --disable-hybrid-swa-memory, the
    KV tier, disaggregation or tensor parallelism (which move a token's KV of every layer at one
    slot), nor for a model whose every layer, or none, has a window."""
    runner = ModelRunner(make_tiny_model(str(tmp_path / "g"), "gemma3"), dtype="float32", progress=False)
    assert local_window(ServerArgs(), runner) == 8
    for kw in ({"disable_hybrid_swa_memory": True}, {"enable_hierarchical_cache": True},
               {"disaggregation_mode": "prefill"}, {"tp_size": 2}):
        assert local_window(ServerArgs().replace(**kw), runner) is None, kw
    for family in ("mistral", "olmo2"):
        other = ModelRunner(make_tiny_model(str(tmp_path / family), family), dtype="float32", progress=False)
        assert local_window(ServerArgs(), other) is None


def test_the_language_model_of_an_image_text_gemma3_checkpoint(tmp_path: Any) -> None:
    """Gemma 3 4B and up ship as image-text checkpoints: their language model runs, text only."""
    text = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                intermediate_size=96, vocab_size=300, head_dim=16, sliding_window=8, eos_token_id=256)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       boi_token_index=290, eoi_token_index=291, image_token_index=292)
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in hf.parameters():  # norms around 0 (Gemma adds 1), the rest at clear-winner scale
            p.copy_(torch.randn(p.shape) * (0.1 if p.dim() == 1 else p.shape[-1] ** -0.5))
    hf.save_pretrained(str(tmp_path))
    from tests.model.tiny_llama import _write_byte_tokenizer

    _write_byte_tokenizer(str(tmp_path))
    runner, h = runner_and_harness(str(tmp_path))
    assert runner.model_config.arch == "gemma3" and runner.model_config.sliding_layers
    tokens = ids(30, seed=5)
    got = runner.forward(h.batch([h.new_request()], [tokens])).logits[0]
    assert rel_err(got, hf_logits(hf, tokens)) < REL_TOL


def _cfg(**kw: Any) -> ModelConfig:
    return ModelConfig("llama", 2, 64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96,
                       vocab_size=257, **kw)


def test_a_whole_model_window_applies_to_every_layer_past_it() -> None:
    """A window shorter than the context becomes a window on every layer; one the context never
    exceeds changes nothing (the layers keep full attention, which equals it there)."""
    assert windowed(_cfg(max_position=4096), None) == (_cfg(max_position=4096), 4096)
    cfg, ctx = windowed(_cfg(max_position=4096, sliding_window=8192), None)
    assert (cfg.sliding_layers, ctx) == ((), 4096)
    cfg, ctx = windowed(_cfg(max_position=32768, sliding_window=4096), None)
    assert (cfg.sliding_layers, ctx) == ((0, 1), 32768)
    cfg, ctx = windowed(_cfg(max_position=32768, sliding_window=4096), 2048)
    assert (cfg.sliding_layers, ctx) == ((), 2048)
    gemma_like = _cfg(max_position=4096, sliding_window=8, sliding_layers=(1,))
    assert windowed(gemma_like, None)[0].sliding_layers == (1,)  # a pattern of its own stays


def test_hf_configs_of_the_families() -> None:
    base = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 4, "intermediate_size": 96,
            "vocab_size": 257}
    mistral = ModelConfig.from_hf_dict({**base, "model_type": "mistral", "sliding_window": 4096})
    assert mistral.arch == "llama" and mistral.sliding_window == 4096
    # Qwen2 names a window but does not use it unless use_sliding_window says so, and then from
    # max_window_layers on (or where layer_types says)
    assert ModelConfig.from_hf_dict({**base, "model_type": "qwen2", "sliding_window": 4096}).sliding_window is None
    qwen = ModelConfig.from_hf_dict({**base, "model_type": "qwen2", "sliding_window": 64, "use_sliding_window": True,
                                     "max_window_layers": 2})
    assert (qwen.sliding_window, qwen.sliding_layers) == (64, (2, 3))
    qwen = ModelConfig.from_hf_dict({**base, "model_type": "qwen2", "sliding_window": 64, "use_sliding_window": True,
                                     "layer_types": ["sliding_attention", "full_attention"] * 2})
    assert qwen.sliding_layers == (0, 2)
    moe = ModelConfig.from_hf_dict({**base, "model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2,
                                    "moe_intermediate_size": 32, "decoder_sparse_step": 2, "norm_topk_prob": True})
    assert moe.arch == "qwen3moe" and moe.dense_layers == (0, 2) and moe.norm_topk_prob
    assert [moe.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    # Phi-3.5's config.json: the older rope_scaling spelling ("su"/"longrope" under "type")
    phi = ModelConfig.from_hf_dict({**base, "model_type": "phi3", "max_position_embeddings": 131072,
                                    "original_max_position_embeddings": 4096,
                                    "rope_scaling": {"type": "su", "short_factor": [1.0] * 8,
                                                     "long_factor": [2.0] * 8}})
    assert phi.rope_scaling is not None and phi.rope_scaling["rope_type"] == "longrope"
    assert phi.rope_scaling["attention_factor"] == pytest.approx((1 + 5 * 0.6931471805599453 / 8.317766166719343) ** 0.5)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        _cfg(num_experts=4, num_experts_per_tok=5)
    olmo = ModelConfig.from_hf_dict({**base, "model_type": "olmo2"})
    assert olmo.norm_layout == "post" and olmo.qk_norm_whole and olmo.qk_norm
    from radixserve.model.parallel import check_tp_size

    with pytest.raises(ValueError, match="normalizes q and k over all heads"):
        check_tp_size(olmo, 2)


@pytest.mark.slow
def test_moe_tp2_equals_tp1(tmp_path: Any) -> None:
    d = make_tiny_model(str(tmp_path / "moe"), "qwen3_moe")
    kw: dict[str, Any] = {"dtype": "float32", "max_total_tokens": 2048}
    prompts = ["some words to route", "and other words"]
    greedy = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    want = [o["output_ids"] for o in Engine(d, **kw).generate(prompts, greedy)]
    with Engine(d, tp_size=2, **kw) as tp2:
        got = [o["output_ids"] for o in tp2.generate(prompts, greedy)]
        tp2.check_memory_invariant()
    assert got == want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_single_token_takes_its_experts_directly_with_the_same_bits(dtype: torch.dtype) -> None:
    """A decode step at batch 1 runs a token's experts without the grouping's gathers and scatters
    (``SparseMoE._one_token``): bit for bit what the grouped path gives it (a speculative verify
    step, whose rows go through the grouped path, must compute what decoding did). Top 4 of 8, so
    the order the experts' outputs are added in matters."""
    from dataclasses import replace

    from radixserve.model.layers import _TORCH_OPS, SparseMoE

    cfg = replace(_cfg(max_position=64), num_experts=8, num_experts_per_tok=4, moe_intermediate_size=32)
    moe = SparseMoE(cfg, torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    moe.to(dtype)
    for seed in range(8):
        x = torch.randn(1, cfg.hidden_size, generator=torch.Generator().manual_seed(seed)).to(dtype)
        probs = torch.softmax(torch.nn.functional.linear(x, moe.gate), dim=-1, dtype=torch.float32)
        weights, chosen = probs.topk(moe.top_k, dim=-1)
        if moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        assert torch.equal(moe(x), moe._grouped(x, weights, chosen, _TORCH_OPS))
