"""Incremental detokenization with stop strings, shared by the in-process engine and the
detokenizer process.

Two rules a streaming client relies on:
- never emit a broken UTF-8 character: a token that ends inside a multi-byte character decodes to
  U+FFFD, so text is held back until the character completes;
- never leak a stop string, even one split across chunks: the longest tail of the text that could
  still grow into a stop string is held back until it can no longer match.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class IncrementalDetokenizer:
    def __init__(
        self,
        decode: Callable[[Sequence[int]], str],
        stop: Sequence[str] = (),
    ) -> None:
        self.decode = decode
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.text = ""  # all text decoded so far (before stop trimming)
        self.sent = 0  # characters of text already emitted
        self._surr = 0
        self._read = 0
        self.stopped_at: int | None = None  # index in text where a stop string begins

    def feed(self, new_ids: Sequence[int], finished: bool = False) -> str:
        """Add tokens; return the text that is now safe to emit."""
        self.ids.extend(new_ids)
        if self.stopped_at is None:
            surr_text = self.decode(self.ids[self._surr : self._read])
            new_text = self.decode(self.ids[self._surr :])
            if len(new_text) > len(surr_text) and (finished or not new_text.endswith("\ufffd")):
                self.text += new_text[len(surr_text) :]
                self._surr, self._read = self._read, len(self.ids)
            self._find_stop()
        end = len(self.text) if self.stopped_at is None else self.stopped_at
        if not finished and self.stopped_at is None:
            end -= self._held_back()
        if end <= self.sent:
            return ""
        out = self.text[self.sent : end]
        self.sent = end
        return out

    @property
    def output_text(self) -> str:
        return self.text if self.stopped_at is None else self.text[: self.stopped_at]

    def _find_stop(self) -> None:
        if not self.stop:
            return
        start = max(self.sent - max(len(s) for s in self.stop), 0)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.stopped_at = min(hits)

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best
