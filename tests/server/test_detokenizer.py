"""The detokenizer process's logic without processes: UTF-8 safety, stop strings split across
outputs, and --stream-interval merging."""

from __future__ import annotations

from typing import Any

import pytest

from radixserve.sched.finish import FINISH_LENGTH
from radixserve.sched.io import BatchOut, DetokParams
from radixserve.server.detokenizer_proc import DetokenizerManager

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
        b = BatchOut()
        b.add("r", chunk, FINISH_LENGTH(len(ids)) if last else None, 3, i + len(chunk), 0)
        if i == 0:
            b.detok_params.append(DetokParams("r", stop or []))
        out = mgr.handle(b)
        deltas += [o.text for o in out or ()]
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


def test_stream_interval_with_many_requests_keeps_each_ones_tokens_together(tokenizer: Any) -> None:
    """Rows of several requests in one record, some due and some held back: each request's text and
    tokens arrive whole and in order, a record of rows that are all due goes out as it came."""
    mgr = DetokenizerManager(tokenizer, stream_interval=2)
    texts = {"a": "alpha beta gamma delta", "b": "one two three four five", "c": "x"}
    ids = {rid: tokenizer.encode(t) for rid, t in texts.items()}
    got_ids: dict[str, list[int]] = {rid: [] for rid in ids}
    got_text: dict[str, str] = {rid: "" for rid in ids}
    step = 0
    while any(len(got) < len(ids[rid]) for rid, got in got_ids.items()) and step < 50:
        b = BatchOut()
        for rid, want in ids.items():
            if step < len(want):
                last = step == len(want) - 1
                b.add(rid, [want[step]], FINISH_LENGTH(len(want)) if last else None, 1, step + 1, 0)
                if step == 0:
                    b.detok_params.append(DetokParams(rid, []))
        out = mgr.handle(b)
        for o in out or ():
            assert o.new_token_ids, "a row is sent only with its tokens"
            got_ids[o.rid] += o.new_token_ids
            got_text[o.rid] += o.text
        step += 1
    assert got_ids == ids
    assert got_text == {rid: tokenizer.decode(v) for rid, v in ids.items()}
    assert not mgr.states and not mgr.params


def test_a_record_whose_rows_are_all_due_is_passed_on_as_it_is(tokenizer: Any) -> None:
    mgr = DetokenizerManager(tokenizer)
    b = BatchOut()
    b.add("r", tokenizer.encode("hello"), FINISH_LENGTH(1), 1, 1, 0)
    out = mgr.handle(b)
    assert out is b and [o.text for o in out] == ["hello"]
