from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from kvharness import Harness

from radixserve.model.config import ModelConfig
from radixserve.model.gguf_file import open_gguf
from radixserve.model.gguf_loader import gguf_to_hf_name, permute_qk, unpermute_qk
from radixserve.model.llama import LlamaForCausalLM
from radixserve.model.loader import default_model_path, load_model, resolve_model_path
from radixserve.model.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")


def test_gguf_name_mapping_covers_every_tensor() -> None:
    reader = open_gguf(default_model_path())
    meta = reader.metadata
    names = [t.name for t in reader.tensors]
    mapped = {gguf_to_hf_name(n) for n in names}
    assert len(mapped) == len(names) == 272
    config = ModelConfig.from_gguf_metadata(meta)
    hf_config = transformers.LlamaConfig(**config.to_hf_dict())
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(hf_config)
    expected = set(hf.state_dict()) - {"lm_head.weight"}  # tied: no output.weight in the file
    assert mapped == expected
    with pytest.raises(KeyError, match="blk.0.attn_foo.weight"):
        gguf_to_hf_name("blk.0.attn_foo.weight")


def test_default_config() -> None:
    config, state = load_model(None, torch.float32, progress=False)
    assert (config.arch, config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (
        "llama",
        30,
        576,
        9,
        3,
    )
    assert (config.head_dim, config.intermediate_size, config.vocab_size) == (64, 1536, 49152)
    assert config.rope_theta == 100000.0 and config.rms_eps == 1e-5 and config.max_position == 8192
    assert config.tie_word_embeddings and not config.attention_bias and not config.qk_norm
    assert (config.bos_token_id, config.eos_token_id) == (1, 2)
    assert "lm_head.weight" not in state
    assert state["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert state["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert state["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
    assert all(t.dtype == torch.float32 for t in state.values())
    hf_dict = config.to_hf_dict()
    assert transformers.LlamaConfig(**hf_dict).num_key_value_heads == 3


def test_qk_unpermute_inverts_llama_cpp_permute() -> None:
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    w = torch.randn(576, 576)
    assert torch.equal(unpermute_qk(permute_qk(w, 9), 9), w)
    k = torch.randn(192)  # biases permute the same way
    assert torch.equal(unpermute_qk(permute_qk(k, 3), 3), k)
    # the same as transformers' own GGUF reverse permutation, on the file's real k weights
    reader = open_gguf(default_model_path())
    from gguf import quants

    t = next(t for t in reader.tensors if t.name == "blk.3.attn_k.weight")
    raw = quants.dequantize(t.data, t.tensor_type).reshape(192, 576)
    theirs = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    expected = theirs.process(np.array(raw), t.name).weights
    assert torch.equal(unpermute_qk(torch.from_numpy(np.array(raw)), 3), torch.from_numpy(expected))


def test_missing_path_is_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load_model(str(missing))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="empty"):
        load_model(str(empty))
    assert resolve_model_path(None) == ("gguf", default_model_path())


TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)


@pytest.mark.parametrize(
    "kind, extra",
    [
        ("llama", {"rope_theta": 10000.0, "tie_word_embeddings": False}),
        ("llama", {"rope_theta": 50000.0, "tie_word_embeddings": True}),
        (
            "llama",
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 32,
                },
                "rope_theta": 500000.0,
            },
        ),
        ("qwen2", {"rope_theta": 1000000.0, "tie_word_embeddings": True}),
        ("qwen3", {"rope_theta": 1000000.0, "head_dim": 32, "tie_word_embeddings": False}),
    ],
)
def test_safetensors_dir_round_trip(tmp_path: Path, kind: str, extra: dict[str, Any]) -> None:
    """A tiny random HF model saved with save_pretrained loads through our loader and matches HF."""
    cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[kind]
    torch.manual_seed(0)
    hf_config = cls[0](**TINY, **extra)
    hf = cls[1](hf_config).eval()
    with torch.no_grad():  # non-trivial norms and biases so a mix-up would show
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(tmp_path, safe_serialization=True)

    config, state = load_model(str(tmp_path), torch.float32, progress=False)
    assert config.arch == kind
    assert config.attention_bias == (kind == "qwen2") and config.qk_norm == (kind == "qwen3")
    assert config.tie_word_embeddings == hf_config.tie_word_embeddings
    model = LlamaForCausalLM.from_state_dict(config, state, torch.float32)
    model.pack_linears()

    from radixserve.mem.kv_pool import KVPool, ReqToTokenPool

    kv = KVPool(512, 4, config.num_layers, config.num_kv_heads, config.head_dim, torch.float32)
    r2t = ReqToTokenPool(4, 128)
    h = Harness(kv, r2t)
    prompts = [
        torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 40, 1)
    ]
    reqs = [h.new_request() for _ in prompts]
    with torch.inference_mode():
        ours = model(h.batch(reqs, prompts), kv, r2t)
        for i, ids in enumerate(prompts):
            ref = hf(torch.tensor([ids])).logits[0, -1]
            assert (ours[i] - ref).abs().max() / ref.abs().max() < 1e-4
        # one decode step of all three on top of their prefills
        nxt = [[int(t)] for t in ours.argmax(-1)]
        ours2 = model(h.batch(reqs, nxt), kv, r2t)
        for i, ids in enumerate(prompts):
            ref = hf(torch.tensor([ids + nxt[i]])).logits[0, -1]
            assert (ours2[i] - ref).abs().max() / ref.abs().max() < 1e-4


def test_tokenizer_from_pretrained_dir(tmp_path: Path, hf_tokenizer: Any) -> None:
    """A directory with tokenizer.json (what save_pretrained writes) builds the same tokenizer."""
    hf_tok = hf_tokenizer
    hf_tok.save_pretrained(tmp_path)
    ours = Tokenizer.from_pretrained_dir(str(tmp_path))
    text = "Hello <|im_start|>user\nwörld 🤖<|im_end|>"
    assert ours.encode(text) == hf_tok(text).input_ids
    assert ours.eos_token_id == 2 and ours.bos_token_id == 1
    msgs = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(msgs) == hf_tok.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=False
    )
