"""The model area of ``ServerArgs``: which model, how its weights run, how its chat is parsed."""

from __future__ import annotations

import os
from dataclasses import dataclass

from radixserve.options import not_positive, option

# --kv-cache-dtype's names (SGLang's and vLLM's: "bf16" and "bfloat16" alike, "fp8" is e4m3);
# mem/kv_format.py says what each stores
KV_CACHE_DTYPES = ("auto", "bf16", "bfloat16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")


@dataclass(frozen=True)
class ModelOptions:
    model_path: str | None = option(
        None, "Local GGUF file or safetensors directory (Llama, Mistral, Mixtral, Qwen2, Qwen3, Qwen3-MoE, Phi-3, Granite, OLMo 2, Gemma 2/3). "
        "Default: the bundled SmolLM2-135M-Instruct GGUF.", group="model"
    )
    served_model_name: str | None = option(None, "Model name reported by the API (default: derived from the path).", group="model")
    reasoning_parser: str | None = option(
        None, "Answer a reasoning model's thinking as reasoning_content, apart from content, in chat "
        "completions: qwen3 (the output opens <think> itself) or deepseek-r1 (the prompt opened it).",
        ("qwen3", "deepseek-r1"), group="model")
    tool_call_parser: str | None = option(
        None, "The format the model writes tool calls in, parsed out of chat answers (tool_choice auto): "
        "hermes (Qwen 2.5/3, Hermes), llama3, mistral, pythonic (Llama 3.2/4). tool_choice required or a "
        "named function works without it (hermes format).",
        ("hermes", "llama3", "mistral", "pythonic"), group="model")
    chat_template: str | None = option(
        None, "Chat template to use instead of the model's own: a Jinja file, or the template text itself "
        "(anything with {{ or {%%).", group="model")
    dtype: str = option("auto", "Weights/activations/KV dtype; auto picks the measured-fastest on this device.", ("auto", "float32", "bfloat16"), group="model")
    kv_cache_dtype: str = option(
        "auto", "How the KV pool stores K and V (docs/kv_tiers.md). auto: the model's --dtype. bf16 (bfloat16), "
        "float32: as computed. int8, fp8_e4m3 (fp8): one byte per value and a float32 scale per token and KV head "
        "(1.88x the tokens of bfloat16 at head_dim 64; perplexity within 0.2%% of bf16 KV on the bundled model). "
        "fp8_e5m2: one byte, no scale, as SGLang and vLLM store fp8 without calibration (2x the tokens; 2 "
        "mantissa bits: +4.5%% perplexity). Prefill, the decode kernel and the torch path all read the stored "
        "values; figures: scripts/bench_kv_cache_dtype.py.",
        KV_CACHE_DTYPES, group="model")
    context_length: int | None = option(None, "Maximum context length (prompt + output); default: the model's. A sliding-window model "
        "attends over its window past it (docs/model.md).", group="model")
    attention_backend: str = option(
        "auto", "Attention implementation. torch_native: gather each request's KV from the pool, then SDPA. "
        "cpu_paged: decode rows by a C++ kernel that reads the KV in place, 1.4x faster decode steps at batch 64 "
        "(compiled by scripts/setup.sh, or on first use; needs g++ and ninja: if it cannot be built, choosing it "
        "fails at start with the reason); it also brings the fused C++ small ops (RMSNorm + residual, RoPE, "
        "SiLU x up; torch_native keeps the torch ones, the reference). auto: cpu_paged when its kernel builds "
        "here, else torch_native (and torch_native for a model with soft-capped attention scores: Gemma 2; both "
        "have sliding windows).",
        ("auto", "torch_native", "cpu_paged"), group="model")
    quantization: str = option(
        "auto", "How the linear weights are held. gguf: a GGUF file's quantized matrices stay in their blocks "
        "(Q4_0-Q8_0, Q2_K-Q6_K, IQ4_NL, IQ4_XS; no float copy: weights take the file's size) and every "
        "forward reads them there, row by row for steps of at most --quantization-max-batch rows, else by "
        "dequantized tiles through the GEMM; the results are the dequantized weights' to float rounding "
        "(a bfloat16 model on a CPU with AVX-512 runs integer VNNI dot products up to 4 rows, 6 for "
        "K-quants, ~15-bit "
        "activations, and bf16 dot products past that). "
        "none: float weights (a GGUF's expanded at load). int4 (groups of 32 with a scale and a minimum, "
        "Q4_1's layout) and int8 (blocks of 32, Q8_0's; one scale per row where ATen's kernel runs): "
        "quantized copies of float weights for small steps. auto: gguf for a GGUF model (under tensor "
        "parallelism each rank keeps its shard's blocks), else none. docs/model.md.",
        ("auto", "none", "gguf", "int8", "int4"), group="model")
    quantization_max_batch: int | None = option(
        None, "Most rows (tokens) of a forward that uses the int8/int4 copies (above it the float weights "
        "run), or that GGUF blocks read row by row (above it: dequantized tiles and the GEMM). Default: "
        "int8/int4 5 when the float weights are bfloat16, 8 when float32; GGUF blocks 64 in float32, in "
        "bfloat16 256 with AVX512-BF16 (its bf16 row kernel), 4 where the CPU also has AMX (the AMX "
        "kernel; 10 if it was not built), else 8 (where each stopped paying: "
        "docs/benchmarks.md, quant.py).", group="model")
    random_seed: int = option(0, "Seed of the global sampler generator.", group="model")
    num_threads: int | None = option(None, "torch intra-op threads (default: torch's choice).", group="model")

    def _model_errors(self) -> list[str]:
        errors: list[str] = []
        t = self.chat_template
        if t is not None and not os.path.isfile(t) and "{{" not in t and "{%" not in t:
            errors.append(f"chat_template {t!r} is neither a file nor a Jinja template")
        for name in ("context_length", "num_threads", "quantization_max_batch"):
            errors += not_positive(self, name)
        return errors
