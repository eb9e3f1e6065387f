"""What the router reads off a request body to route it: the prompt a tree policy matches."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from radixserve.router.policy import RouteRequest

if TYPE_CHECKING:
    from radixserve.model.tokenizer import Tokenizer


def prompt_key(path: str, body: dict[str, Any], tok: Tokenizer | None) -> RouteRequest:
    """What a tree policy matches of a request: its prompt as tokens (with ``tok``, the model's
    tokenizer) or as text; a chat (or a Responses conversation) as its messages."""
    if path == "/v1/responses":  # route by the conversation's text: instructions, then the input
        inp = body.get("input")
        items = [{"role": "user", "content": inp}] if isinstance(inp, str) else inp if isinstance(inp, list) else []
        system = [{"role": "system", "content": body["instructions"]}] if body.get("instructions") else []
        body = {"messages": [*system, *items]}
        path = "/v1/chat/completions"
    if path == "/v1/chat/completions":
        messages = body.get("messages")
        if not isinstance(messages, list):
            return RouteRequest()
        if tok is not None:
            try:
                return RouteRequest(tokens=tok.encode_chat(messages))
            except Exception:  # a template that rejects these messages: the worker will say why
                return RouteRequest()
        return RouteRequest(text="".join(_message_text(m) for m in messages))
    prompt = body.get("text") if path == "/generate" else body.get("prompt")
    if path == "/generate" and prompt is None:
        prompt = body.get("input_ids")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch goes to one worker: route by its first prompt
    if isinstance(prompt, str):
        return RouteRequest(tokens=tok.encode(prompt)) if tok is not None else RouteRequest(text=prompt)
    if isinstance(prompt, list) and all(isinstance(x, int) for x in prompt):
        return RouteRequest(tokens=prompt)  # token ids are matched as they are, in either mode
    return RouteRequest()


def _message_text(m: Any) -> str:
    if not isinstance(m, dict):
        return ""
    content = m.get("content")
    if isinstance(content, list):  # content parts: keep the text ones
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return f"{m.get('role', '')}: {content if isinstance(content, str) else ''}\n"
