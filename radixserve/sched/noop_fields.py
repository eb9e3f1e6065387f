"""Fields SGLang's or vLLM's request schemas define that this server does not act on.

Gateways and routers built for those servers re-send every request with such fields at their
defaults (vLLM's router adds SGLang's ``no_stop_trim``, ``separate_reasoning``, ...; SGLang's
gateway adds ``model``, ``log_metrics``, ``no_logs``, ... to native ``/generate`` bodies). Each
field is accepted at the value(s) that change nothing here and refused with a 400 ``unsupported``
naming it at any other; a field neither server defines stays a 400 ``unknown_parameter``.

Tables: field -> the values that change nothing (a type: any value of it). ``None`` is always one of
them (an explicit null is the field left out)."""

from __future__ import annotations

import json
from typing import Any

# both OpenAI routes (SGLang's names, then vLLM's)
_OPENAI: dict[str, tuple[Any, ...]] = {
    "return_hidden_states": (False,), "return_routed_experts": (False,), "routed_experts_start_len": (0,),
    "return_cached_tokens_details": (False,), "return_spec_tokens_details": (False,),
    "stop_regex": (), "no_stop_trim": (False,), "lora_path": (), "session_id": (), "session_params": (),
    "custom_params": (), "custom_logit_processor": (), "watermark": (), "images_config": (),
    "mm_processor_kwargs": (), "rid": (), "extra_key": (), "cache_salt": (), "custom_labels": (),
    "use_beam_search": (False,), "length_penalty": (1.0,), "include_stop_str_in_output": (False,),
    "spaces_between_special_tokens": (True,), "truncate_prompt_tokens": (), "prompt_logprobs": (),
    "allowed_token_ids": (), "bad_words": ([],), "add_special_tokens": (False,), "guided_json": (),
    "guided_regex": (), "guided_choice": (), "guided_grammar": (), "structural_tag": (),
    "guided_decoding_backend": (), "guided_whitespace_pattern": (), "logits_processors": (),
    "return_tokens_as_token_ids": (False,), "kv_transfer_params": (), "vllm_xargs": (), "request_id": (),
}
CHAT: dict[str, tuple[Any, ...]] = {
    **_OPENAI,
    "return_prompt_token_ids": (False,), "return_token_ids": (False,), "return_meta_info": (False,),
    "return_input_ids_in_sglext": (False,), "return_output_ids_in_sglext": (False,),
    "return_sampling_mask": (False,), "sampling_logprobs_mode": (),
    "return_flat_raw_output_top_logprobs": (False,), "return_flat_raw_top_logprobs_b64": (True, False),
    "thinking": (), "task": (), "continue_final_message": (False,), "stream_reasoning": (True,),
    "include_reasoning": (True,), "max_dynamic_patch": (), "min_dynamic_patch": (),
    "use_audio_in_video": (False,), "video_config": (), "input_ids": (), "best_of": (1,), "echo": (False,),
    "add_generation_prompt": (True,), "documents": (), "chat_template": (),
}
COMPLETION: dict[str, tuple[Any, ...]] = {**_OPENAI}
# native /generate (SGLang's GenerateReqInput, and the model name its gateway adds)
NATIVE: dict[str, tuple[Any, ...]] = {
    "model": (str,), "session_id": (), "session_params": (), "input_embeds": (), "image_data": (),
    "video_data": (), "audio_data": (), "modalities": (), "lora_path": (), "lora_id": (),
    "custom_logit_processor": (), "log_metrics": (True,), "no_logs": (False,),
    "return_hidden_states": (False,), "return_routed_experts": (False,), "routed_experts_start_len": (0,),
    "return_bytes": (False,), "return_entropy": (False,), "return_prompt_token_ids": (False,),
    "return_sampling_mask": (False,), "token_ids_logprob": (), "return_flat_raw_top_logprobs": (False,),
    "return_flat_raw_output_top_logprobs": (False,), "return_flat_raw_top_logprobs_b64": (False, True),
    "background": (False,), "require_reasoning": (False,), "max_thinking_tokens": (), "extra_key": (),
    "cache_salt": (), "custom_labels": (), "routing_key": (), "conversation_id": (),
    "bootstrap_pair_key": (), "decode_tp_size": (), "routed_dp_rank": (), "disagg_prefill_dp_rank": (),
    "external_trace_header": (), "watermark": (), "use_audio_in_video": (False,), "video_config": (),
}
# keys of a native request's sampling_params (SGLang's SamplingParams)
SAMPLING: dict[str, tuple[Any, ...]] = {
    "n": (1,), "no_stop_trim": (False,), "spaces_between_special_tokens": (True,), "stop_regex": (),
    "structural_tag": (), "custom_params": (), "stream_interval": (), "sampling_seed": (),
}


def same(a: Any, b: Any) -> bool:
    """Equal as JSON values: true is not 1, but 1 and 1.0 are the same number."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    return type(a) is type(b) and a == b


def refusal(table: dict[str, tuple[Any, ...]], name: str, value: Any) -> str | None:
    """Why ``name: value`` is refused (a sentence), or None when it changes nothing here."""
    accepted = table[name]
    if value is None or any(isinstance(value, a) if isinstance(a, type) else same(value, a) for a in accepted):
        return None
    allowed = " or ".join(["null", *("a string" if a is str else json.dumps(a) for a in accepted)])
    return f"{name} is accepted only as {allowed} (this server does not implement it)"



def noop_schema(accepted: tuple[Any, ...]) -> dict[str, Any]:
    """The JSON schema of a no-op field: its accepted values (and null); ``x-noop`` marks it."""
    if any(isinstance(a, type) for a in accepted):
        return {"type": ["string", "null"], "description": "Accepted; this server serves one model.", "x-noop": True}
    return {"enum": [None, *accepted], "description": "Accepted only at these values (not implemented here).",
            "x-noop": True}
