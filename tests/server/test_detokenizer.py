"""The detokenizer process's logic without processes: UTF-8 safety, stop strings split across
outputs, and --stream-interval merging."""

from __future__ import annotations

from typing import Any

import pytest

from radixserve.server.detokenizer_proc import DetokenizerManager
from radixserve.server.io_struct import BatchTokenOut, FinishReason, TokenOut

TEXT = "naïve café déjà vu — 東京 ✓ 🙂 done"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from radixserve.model.tokenizer import Tokenizer

    return Tokenizer.from_model_path(None)


def _feed(mgr: DetokenizerManager, ids: list[int], stop: list[str] | None = None, per_step: int = 1) -> list[str]:
    deltas = []
    for i in range(0, len(ids), per_step):
        chunk = ids[i : i + per_step]
        last = i + per_step >= len(ids)
        out = TokenOut("r", chunk, FinishReason("length") if last else None, 3, i + len(chunk), 0, stop=stop)
        deltas += [s.text for s in mgr.handle(BatchTokenOut([out]))]
    return deltas


def test_never_broken_utf8(tokenizer: Any) -> None:
    ids = tokenizer.encode(TEXT)
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)  # some tokens are partial characters
    deltas = _feed(DetokenizerManager(tokenizer), ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids)


def test_stop_string_split_across_outputs_never_leaks(tokenizer: Any) -> None:
    ids = tokenizer.encode(TEXT)
    full = tokenizer.decode(ids)
    stop = "vu — 東"
    deltas = _feed(DetokenizerManager(tokenizer), ids, stop=[stop])
    # exactly the text before the stop string: no part of it was ever sent, even while it was
    # only a possible beginning of the stop string
    assert "".join(deltas) == full[: full.index(stop)]


def test_stream_interval_merges(tokenizer: Any) -> None:
    ids = tokenizer.encode("one two three four five six seven")
    mgr = DetokenizerManager(tokenizer, stream_interval=3)
    deltas = _feed(mgr, ids)
    assert len(deltas) == -(-len(ids) // 3)
    assert "".join(deltas) == tokenizer.decode(ids)
    assert not mgr.states  # finished requests are forgotten
