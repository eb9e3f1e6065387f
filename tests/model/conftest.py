from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # for kvharness


@pytest.fixture(scope="session")
def fp32_runner() -> Any:
    """The bundled SmolLM2 in float32, loaded once for every model test."""
    from radixserve.model.model_runner import ModelRunner

    return ModelRunner(None, dtype="float32", seed=1234, progress=False)


@pytest.fixture(scope="session")
def hf_model(fp32_runner: Any) -> Any:
    """transformers' LlamaForCausalLM with OUR dequantized weights, float32."""
    transformers = pytest.importorskip("transformers")
    from radixserve.model.loader import load_model

    config, state = load_model(None, torch.float32, progress=False)
    assert config == fp32_runner.model_config
    hf_config = transformers.LlamaConfig(**config.to_hf_dict())
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(hf_config)
    result = model.load_state_dict(state, strict=False, assign=True)
    assert not result.unexpected_keys
    assert set(result.missing_keys) <= {"lm_head.weight"}
    model.tie_weights()
    model.model.rotary_emb.__init__(hf_config)  # its inv_freq buffer was built on the meta device
    return model.eval()


@pytest.fixture(scope="session")
def hf_tokenizer() -> Any:
    """transformers' own conversion of the bundled GGUF's tokenizer."""
    transformers = pytest.importorskip("transformers")
    from radixserve.model.loader import default_model_path

    path = default_model_path()
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
