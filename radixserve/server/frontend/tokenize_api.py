"""``/tokenize`` and ``/detokenize``, in vLLM's request and response shapes.

``POST /tokenize`` takes either ``prompt`` (text, encoded as a completion prompt is) or
``messages`` (a chat, rendered by the model's chat template as ``/v1/chat/completions`` renders it)
and answers ``{"count", "max_model_len", "tokens", "token_strs"}``; ``POST /detokenize`` takes
``tokens`` and answers ``{"prompt": text}``. Both run in the HTTP process on its own tokenizer: they
never reach the scheduler.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import Field
from starlette.requests import Request

from radixserve.server.frontend.chat_protocol import ChatMessage, check_template_kwargs
from radixserve.server.frontend.common import render_chat
from radixserve.server.frontend.protocol import APIError, _Body, parse_body, unsupported
from radixserve.server.frontend.tokenizer_manager import TokenizerManager


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = Field(None, description="Text to encode (exactly one of prompt and messages).")
    messages: list[ChatMessage] | None = Field(
        None, min_length=1, description="A chat, rendered by the model's chat template before encoding.")
    add_special_tokens: bool | None = Field(
        None, description="Add the tokenizer's special tokens (BOS); default true for prompt, false for "
        "messages (the template writes them).")
    add_generation_prompt: bool = Field(True, description="messages only: end with the assistant's turn opener.")
    continue_final_message: bool = Field(False, description="Only false.")
    return_token_strs: bool = Field(False, description="Also answer each token's vocabulary string.")
    chat_template: str | None = Field(None, description="Not supported: refused.")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="Extra variables for the chat template.")
    tools: list[dict[str, Any]] | None = Field(None, description="Not supported: refused.")

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError("pass exactly one of prompt and messages", param="prompt")
        if self.messages is None:
            for name in ("add_generation_prompt", "continue_final_message"):
                if name in self.model_fields_set:
                    raise APIError(f"{name} applies to messages only", param=name)
        if self.continue_final_message:
            raise unsupported("continue_final_message", "only false is supported")
        check_template_kwargs(self.chat_template_kwargs)
        for name in ("chat_template", "tools"):
            if getattr(self, name) is not None:
                raise unsupported(name, "not supported by /tokenize")


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int] = Field(description="Token ids to decode.")
    skip_special_tokens: bool = Field(False, description="Leave special tokens (BOS, EOS...) out of the text.")


def add_tokenize_routes(app: FastAPI, tm: TokenizerManager, check_model: Any) -> None:
    tokenizer = tm.tokenizer

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = parse_body(await request.body(), TokenizeRequest)
        check_model(body.model)
        if body.messages is not None:
            text = render_chat(tokenizer, body.messages, body.add_generation_prompt, body.chat_template_kwargs)
            special = bool(body.add_special_tokens)
        else:
            text = body.prompt or ""
            special = body.add_special_tokens is not False
        ids = tokenizer.encode(text, add_special_tokens=special)
        strs = [tokenizer.id_to_token(t) for t in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": tm.context_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = parse_body(await request.body(), DetokenizeRequest)
        check_model(body.model)
        vocab = tokenizer.vocab_size
        bad = next((i for i, t in enumerate(body.tokens) if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(f"tokens[{bad}] = {body.tokens[bad]} is not a token id in [0, {vocab})",
                           param="tokens", code="invalid_value")
        return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=body.skip_special_tokens)}
