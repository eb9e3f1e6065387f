"""Logprobs in OpenAI's two wire shapes: chat's ``logprobs.content`` (one entry per token, with its
bytes and top alternatives) and the legacy completions object (parallel ``tokens``,
``token_logprobs``, ``top_logprobs`` and ``text_offset`` lists), echoed prompts included."""

from __future__ import annotations

from typing import Any

from radixserve.model.tokenizer import Tokenizer
from radixserve.server.frontend.req_state import ReqState

TopLogprobs = list[list[tuple[int, float]]]


class LogprobFormat:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def token_str(self, tid: int) -> str:
        return self.tokenizer.decode([tid], False)

    def chat(self, ids: list[int], lps: list[float], tops: TopLogprobs) -> list[dict[str, Any]]:
        tok, out = self.tokenizer, []
        for k, (tid, lp) in enumerate(zip(ids, lps, strict=False)):
            top = tops[k] if k < len(tops) else []
            out.append({
                "token": self.token_str(tid), "logprob": lp, "bytes": list(tok.token_bytes(tid)),
                "top_logprobs": [{"token": self.token_str(t), "logprob": v, "bytes": list(tok.token_bytes(t))}
                                 for t, v in top],
            })
        return out

    def completion(self, ids: list[int], lps: list[float], tops: TopLogprobs, offset: int) -> dict[str, Any]:
        """``offset``: where the first token's text starts in the choice's text."""
        tokens = [self.token_str(t) for t in ids]
        text_offset = []
        for t in tokens:
            text_offset.append(offset)
            offset += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": list(lps),
            "top_logprobs": [{self.token_str(t): v for t, v in (tops[k] if k < len(tops) else [])}
                             for k in range(len(ids))],
            "text_offset": text_offset,
        }

    def echoed(self, st: ReqState, lp: dict[str, Any]) -> dict[str, Any]:
        """``lp`` after the echoed prompt's logprobs (the first token's null: nothing precedes it), when
        the request has them."""
        p = st.input_logprobs
        if p is None:
            return lp
        prompt = self.completion(p.token_ids, p.logprobs, [], 0)  # type: ignore[arg-type]
        prompt["top_logprobs"] = [None if top is None else {self.token_str(t): v for t, v in top}
                                  for top in p.top_logprobs]
        return {key: prompt[key] + lp[key] for key in prompt}
