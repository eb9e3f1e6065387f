"""The detokenizer process: token ids in, safe text deltas out.

One ``IncrementalDetokenizer`` per request turns new token ids into text that never ends inside
a UTF-8 character and never shows a stop string, even one split across two outputs (the tail
that could still grow into a stop string is held back). With ``--stream-interval N`` the outputs
of a request are merged until N new tokens have gathered or it finishes.
"""

from __future__ import annotations

import logging
import sys
import time
import traceback
from dataclasses import dataclass, field

import zmq

from radixserve.config import ServerArgs
from radixserve.model.detokenize import IncrementalDetokenizer
from radixserve.model.tokenizer import Tokenizer
from radixserve.sched.io import BatchOut, DetokParams
from radixserve.server.io_struct import ENCODER, ProcReady, decoder
from radixserve.server.procs import IpcNames, child_init, drain, parent_alive, pull_socket, push_socket

logger = logging.getLogger(__name__)

POLL_S = 0.2


@dataclass
class _DetokState:
    detok: IncrementalDetokenizer
    text: str = ""  # merged, not yet sent (stream_interval > 1)
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


class DetokenizerManager:
    def __init__(self, tokenizer: Tokenizer, stream_interval: int = 1) -> None:
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval
        self.states: dict[str, _DetokState] = {}
        self.params: dict[str, DetokParams] = {}  # announced, not yet seen in a row

    def handle(self, batch: BatchOut) -> BatchOut | None:
        """``batch`` with its ``texts`` column filled, the same record when every row goes out (the
        common case); with ``--stream-interval`` a new one holding the rows due (None: none is)."""
        for p in batch.detok_params:
            self.params[p.rid] = p
        texts: list[str] = []
        merged: BatchOut | None = None  # rows held back or merged: the rows due, rebuilt
        for i, o in enumerate(batch):
            st = self.states.get(o.rid)
            if st is None:
                st = self.states[o.rid] = self._new_state(o.rid)
            finished = o.finished_reason is not None
            text = st.detok.feed(o.new_token_ids, finished=finished)
            if finished:
                del self.states[o.rid]
            if self.stream_interval == 1:
                texts.append(text)
                continue
            fresh = not st.ids  # nothing held back for this request before this row
            st.text += text
            st.ids.extend(o.new_token_ids)
            st.logprobs.extend(o.new_logprobs)
            st.top_logprobs.extend(o.new_top_logprobs)
            if not finished and len(st.ids) < self.stream_interval:
                if merged is None:
                    merged = self._rows_before(batch, i, texts)
                continue
            if merged is None and fresh:
                texts.append(st.text)  # nothing merged into this row: it goes as it is
            else:
                if merged is None:
                    merged = self._rows_before(batch, i, texts)
                merged.add_row(o, st.ids, st.logprobs, st.top_logprobs, st.text)
            st.text, st.ids, st.logprobs, st.top_logprobs = "", [], [], []
        if merged is not None:
            return merged if merged.rids else None
        batch.texts = texts
        batch.detok_params = []
        return batch

    def _new_state(self, rid: str) -> _DetokState:
        p = self.params.pop(rid, None)
        tok = self.tokenizer
        skip = p.skip_special_tokens if p is not None else True
        return _DetokState(IncrementalDetokenizer(lambda ids: tok.decode(ids, skip), p.stop if p is not None else ()))

    @staticmethod
    def _rows_before(batch: BatchOut, n: int, texts: list[str]) -> BatchOut:
        """A new record with ``batch``'s first ``n`` rows (all sent as they were) and their texts."""
        out = BatchOut(dp_rank=batch.dp_rank, input_logprobs=batch.input_logprobs)
        for k in range(n):
            o = batch[k]
            out.add_row(o, o.new_token_ids, o.new_logprobs, o.new_top_logprobs, texts[k])
        return out


def run_detokenizer_process(args: ServerArgs, ipc: IpcNames, parent_pid: int, tokenizer: Tokenizer | None = None) -> None:
    """``tokenizer``: the HTTP process's, sent along (unpickling it takes half the time of loading
    it from the model file again); None: load it."""
    child_init(args.log_level, "Detokenizer", progress_bars=False)
    ctx = zmq.Context()
    recv_sock = pull_socket(ctx, ipc.detokenizer)
    to_tm = push_socket(ctx, ipc.tokenizer)
    try:
        if tokenizer is None:
            tokenizer = Tokenizer.from_model_path(args.model_path)
        manager = DetokenizerManager(tokenizer, args.stream_interval)
    except Exception as e:
        logger.error("detokenizer failed to start:\n%s", traceback.format_exc())
        to_tm.send(ENCODER.encode(ProcReady("detokenizer", error=f"{type(e).__name__}: {e}")))
        time.sleep(0.2)
        sys.exit(1)
    to_tm.send(ENCODER.encode(ProcReady("detokenizer")))
    dec = decoder(BatchOut)
    try:
        while parent_alive(parent_pid):
            if not recv_sock.poll(int(POLL_S * 1000)):
                continue
            for raw in drain(recv_sock):
                out = manager.handle(dec.decode(raw))
                if out is not None:
                    to_tm.send(ENCODER.encode(out))
    finally:
        ctx.destroy(linger=0)
