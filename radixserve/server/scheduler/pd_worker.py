"""Prefill/decode disaggregation in the scheduler process: the glue between ``SchedulerServer`` and
``radixserve.disagg`` (docs/scale-out.md).

The scheduler itself knows nothing of it. A prefill worker runs a room's request with
``max_new_tokens = 1`` and, when it finishes, hands the prompt's KV (in the radix cache by then) to
``PrefillRooms``. A decode worker holds a room's request here until its KV has arrived and sits in
the radix cache, locked; then it queues the request with ``output_ids = [first token]``, which the
scheduler treats like a retracted request coming back: the prompt matches the cache whole, and its
only extend is the first token, a decode step. The lock is dropped once the scheduler admitted the
request (its own lock holds the prefix from there) or finished it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import zmq

from radixserve.config import ServerArgs
from radixserve.disagg.decode import DecodeRooms, NoKVRoom, RoomFailure
from radixserve.disagg.prefill import PrefillRooms
from radixserve.sched.core import SchedulerCore
from radixserve.sched.finish import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP
from radixserve.sched.io import BatchOut, DetokParams
from radixserve.sched.kv_manager import Hold
from radixserve.sched.req import Req
from radixserve.server.io_struct import GenerateReq

logger = logging.getLogger(__name__)

Send = Callable[[BatchOut], None]


def _abort(req: Req, message: str, status: int, code: str) -> BatchOut:
    out = BatchOut()
    out.add(req.rid, [], FINISH_ABORT(message, status_code=status, code=code), req.prompt_len, 0, 0)
    return out


class PDWorker:
    def __init__(self, args: ServerArgs, sched: SchedulerCore, ctx: zmq.Context, dp_rank: int) -> None:
        self.args = args
        self.sched = sched
        self.mode = args.disaggregation_mode
        kv = sched.kv
        pool = getattr(sched.runner, "kv_pool", None)
        if pool is None:
            raise ValueError("--disaggregation-mode needs a runner with a KV pool")
        timeout = args.disaggregation_timeout_secs
        self.prefill: PrefillRooms | None = None
        self.decode: DecodeRooms | None = None
        if self.mode == "prefill":
            endpoint = f"tcp://{args.host}:{args.disaggregation_bootstrap_port + dp_rank}"
            self.prefill = PrefillRooms(ctx, endpoint, kv, pool, timeout, backend=args.disaggregation_transfer_backend)
            logger.info("prefill worker: bootstrap server on %s", endpoint)
        else:
            self.decode = DecodeRooms(ctx, args.host, kv, pool, args.num_reserved_decode_tokens, timeout,
                                      backend=args.disaggregation_transfer_backend,
                                      on_kv=getattr(sched.runner, "kv_written", None))
            logger.info("decode worker: receiving KV on %s", self.decode.rx.endpoint)
        self.poller = zmq.Poller()
        for s in (self.prefill or self.decode).sockets:  # type: ignore[union-attr]
            self.poller.register(s, zmq.POLLIN)
        self.prefill_rooms: dict[str, tuple[int, list[int]]] = {}  # rid -> (room, prompt)
        self.first_tokens: dict[str, tuple[int, float | None]] = {}  # rid -> first token seen (prefill)
        self.holds: list[tuple[Req, Hold]] = []  # decode: received prefixes pinned until admission

    @classmethod
    def create(cls, args: ServerArgs, sched: SchedulerCore, ctx: zmq.Context, dp_rank: int) -> PDWorker | None:
        if getattr(args, "disaggregation_mode", "null") == "null":
            return None
        return cls(args, sched, ctx, dp_rank)

    # --- the scheduler process's loop -----------------------------------------------------------
    def wait(self, recv_sock: zmq.Socket, timeout_ms: int) -> bool:
        """Like ``recv_sock.poll``, but also woken by the disaggregation sockets."""
        self.poller.register(recv_sock, zmq.POLLIN)
        try:
            return bool(self.poller.poll(timeout_ms))
        finally:
            self.poller.unregister(recv_sock)

    def tick(self, send: Send) -> list[Req]:
        """Called before each step: move rooms on; returns decode requests whose KV arrived."""
        if self.prefill is not None:
            self.prefill.poll()
            return []
        assert self.decode is not None
        self._release_holds()
        ready: list[Req] = []
        outs = BatchOut()
        for a in self.decode.poll():
            req: Req = a.payload
            if a.failure is not None:
                status = 504 if a.failure is RoomFailure.TIMED_OUT else 502
                outs.extend(_abort(req, a.error, status, "disaggregation_error"))
                continue
            req.output_ids = [a.first_token]
            if req.sampling_params.logprobs:
                req.output_logprobs = [a.logprob if a.logprob is not None else 0.0]
                if req.sampling_params.top_logprobs_num:
                    req.output_top_logprobs = [[]]
            first = a.first_token
            done = (FINISH_STOP(first) if first in req.finish_token_ids
                    else FINISH_LENGTH(1) if req.max_new_tokens <= 1 else None)
            if done is not None:  # the first token is the whole answer: nothing to decode
                self.sched.kv.unlock(a.hold)
                outs.add(req.rid, [first], done, req.prompt_len, 1, req.prompt_len,
                         list(req.output_logprobs), list(req.output_top_logprobs))
                sp = req.sampling_params
                outs.detok_params.append(DetokParams(req.rid, sp.stop, sp.skip_special_tokens))
                continue
            self.holds.append((req, a.hold))
            ready.append(req)
        if outs:
            send(outs)
        return ready

    def _release_holds(self) -> None:
        keep = []
        for req, hold in self.holds:
            if req.req_pool_idx is not None or req.finished_reason is not None:
                self.sched.kv.unlock(hold)
            else:
                keep.append((req, hold))
        self.holds = keep

    def on_request(self, msg: GenerateReq, req: Req, send: Send) -> Req | None:
        """A request with a bootstrap room: returns it to queue now, or None (held, or refused)."""
        b = msg.bootstrap
        assert b is not None
        if self.prefill is not None:
            # the prefill worker produces the first token only; the decode worker the rest
            req.sampling_params.max_new_tokens = 1
            self.prefill_rooms[req.rid] = (b.room, list(req.origin_input_ids))
            return req
        assert self.decode is not None
        bootstrap = f"tcp://{b.host}:{b.port + b.prefill_rank}"
        try:
            self.decode.open(b.room, bootstrap, req.origin_input_ids, req)
        except NoKVRoom as e:
            send(_abort(req, str(e), 429, "kv_exhausted"))
            return None
        except ValueError as e:
            send(_abort(req, str(e), 400, "invalid_request"))
            return None
        return None

    def on_outputs(self, outs: BatchOut) -> None:
        """Prefill side: a room's request finished; its KV goes to the decode worker."""
        if self.prefill is None or not self.prefill_rooms:
            return
        for o in outs:
            if o.rid not in self.prefill_rooms:
                continue
            if o.new_token_ids:
                lp = o.new_logprobs[-1] if o.new_logprobs else None
                self.first_tokens[o.rid] = (o.new_token_ids[0], lp)
            if o.finished_reason is None:
                continue
            room, prompt = self.prefill_rooms.pop(o.rid)
            first = self.first_tokens.pop(o.rid, None)
            if isinstance(o.finished_reason, FINISH_ABORT) or first is None:
                msg = o.finished_reason.message if isinstance(o.finished_reason, FINISH_ABORT) else ""
                self.prefill.on_prefilled(room, prompt, None, None, error=msg or "no token")
            else:
                self.prefill.on_prefilled(room, prompt, first[0], first[1])

    def abort(self, rid: str, send: Send) -> bool:
        """A client abort of a decode request still waiting for its KV."""
        if self.decode is None:
            return False
        req = self.decode.abort(lambda r: r.rid == rid)
        if req is None:
            return False
        send(_abort(req, "aborted by the client", 499, "aborted"))
        return True

    # --- introspection --------------------------------------------------------------------------
    def idle(self) -> bool:
        rooms = self.prefill or self.decode
        return rooms is not None and rooms.idle() and not self.holds

    def stats(self) -> dict[str, Any]:
        st = self.sched.stats
        out: dict[str, Any] = {"mode": self.mode, "prompt_tokens": st.prompt_tokens,
                               "cached_tokens": st.cached_tokens, "prefill_tokens": st.prefill_tokens,
                               "page_size": self.sched.kv.page_size}
        pool = self.sched.runner.kv_pool  # type: ignore[attr-defined]
        out["kv_bytes_per_token"] = pool.bytes_per_token_here()
        out["kv_cache_dtype"] = pool.format.name
        if self.prefill is not None:
            out.update(vars(self.prefill.stats))
            out["endpoint"] = self.prefill.endpoint
        if self.decode is not None:
            out.update(vars(self.decode.stats))
            out["rooms_waiting"] = len(self.decode.rooms)
            out["endpoint"] = self.decode.rx.endpoint
        return out
