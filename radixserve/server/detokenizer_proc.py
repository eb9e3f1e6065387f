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
from radixserve.server.io_struct import (
    ENCODER,
    BatchStrOut,
    BatchTokenOut,
    ProcReady,
    StrOut,
    TokenOut,
    decoder,
)
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

    def handle(self, batch: BatchTokenOut) -> list[StrOut]:
        outs: list[StrOut] = []
        for o in batch.outputs:
            out = self.handle_one(o)
            if out is not None:
                outs.append(out)
        return outs

    def handle_one(self, o: TokenOut) -> StrOut | None:
        st = self.states.get(o.rid)
        if st is None:
            tok = self.tokenizer
            skip = o.skip_special_tokens
            st = self.states[o.rid] = _DetokState(
                IncrementalDetokenizer(lambda ids: tok.decode(ids, skip), o.stop or ())
            )
        finished = o.finished_reason is not None
        st.text += st.detok.feed(o.new_token_ids, finished=finished)
        st.ids.extend(o.new_token_ids)
        st.logprobs.extend(o.new_logprobs)
        st.top_logprobs.extend(o.new_top_logprobs)
        if finished:
            del self.states[o.rid]
        elif len(st.ids) < self.stream_interval:
            return None
        out = StrOut(
            rid=o.rid, text=st.text, new_token_ids=st.ids, finished_reason=o.finished_reason,
            prompt_tokens=o.prompt_tokens, completion_tokens=o.completion_tokens, cached_tokens=o.cached_tokens,
            new_logprobs=st.logprobs, new_top_logprobs=st.top_logprobs, queue_time=o.queue_time,
            num_retractions=o.num_retractions, dp_rank=o.dp_rank,
        )
        st.text, st.ids, st.logprobs, st.top_logprobs = "", [], [], []
        return out


def run_detokenizer_process(args: ServerArgs, ipc: IpcNames, parent_pid: int) -> None:
    child_init(args.log_level, "Detokenizer")
    ctx = zmq.Context()
    recv_sock = pull_socket(ctx, ipc.detokenizer)
    to_tm = push_socket(ctx, ipc.tokenizer)
    try:
        manager = DetokenizerManager(Tokenizer.from_model_path(args.model_path), args.stream_interval)
    except Exception as e:
        logger.error("detokenizer failed to start:\n%s", traceback.format_exc())
        to_tm.send(ENCODER.encode(ProcReady("detokenizer", error=f"{type(e).__name__}: {e}")))
        time.sleep(0.2)
        sys.exit(1)
    to_tm.send(ENCODER.encode(ProcReady("detokenizer")))
    dec = decoder(BatchTokenOut)
    try:
        while parent_alive(parent_pid):
            if not recv_sock.poll(int(POLL_S * 1000)):
                continue
            for raw in drain(recv_sock):
                outs = manager.handle(dec.decode(raw))
                if outs:
                    to_tm.send(ENCODER.encode(BatchStrOut(outs)))
    finally:
        ctx.destroy(linger=0)
