"""The data-parallel controller (``--dp-size N``): one process between the HTTP process and N
scheduler processes, as SGLang's ``DataParallelController``.

    TokenizerManager ──PUSH──> controller ──PUSH──> scheduler rank 0 .. N-1 ──> detokenizer
                                   ^                        │
                                   └──── RankLoad ──────────┘

- ``GenerateReq``: to the rank it names (``data_parallel_rank``, validated by the HTTP process),
  else to the rank ``--load-balance-method`` picks (``DPBalancer``).
- ``AbortReq`` and ``ControlReq``: to every rank (an abort of a request a rank does not hold is a
  no-op there; each rank answers a control request itself, and the HTTP process gathers them).
- ``RankLoad`` from the ranks keeps the balancer's view of their loads; between two reports the
  controller adds what it has just sent, so a burst does not all go to the same rank.
"""

from __future__ import annotations

import logging

import zmq

from radixserve.config import ServerArgs
from radixserve.server.io_struct import (
    ENCODER,
    AbortReq,
    ControlReq,
    GenerateReq,
    ProcReady,
    RankLoad,
    ToController,
    decoder,
)
from radixserve.server.procs import IpcNames, child_init, drain, parent_alive, pull_socket, push_socket

logger = logging.getLogger(__name__)
POLL_MS = 50


class DPBalancer:
    """Picks a rank for a request: ``round_robin``, ``shortest_queue`` (fewest requests) or
    ``minimum_tokens`` (fewest tokens in use or waiting). Ties go to the lowest rank."""

    def __init__(self, method: str, dp_size: int) -> None:
        if method not in ("round_robin", "shortest_queue", "minimum_tokens"):
            raise ValueError(f"unknown load balance method {method!r}")
        self.method = method
        self.dp_size = dp_size
        self.num_reqs = [0] * dp_size
        self.num_tokens = [0] * dp_size
        self._next = 0

    def pick(self, input_len: int) -> int:
        if self.method == "round_robin":
            rank = self._next
            self._next = (self._next + 1) % self.dp_size
        elif self.method == "shortest_queue":
            rank = min(range(self.dp_size), key=lambda r: (self.num_reqs[r], self.num_tokens[r], r))
        else:
            rank = min(range(self.dp_size), key=lambda r: (self.num_tokens[r], self.num_reqs[r], r))
        self.sent(rank, input_len)
        return rank

    def sent(self, rank: int, input_len: int) -> None:
        self.num_reqs[rank] += 1
        self.num_tokens[rank] += input_len

    def report(self, load: RankLoad) -> None:
        if 0 <= load.dp_rank < self.dp_size:
            self.num_reqs[load.dp_rank] = load.num_reqs
            self.num_tokens[load.dp_rank] = load.num_tokens


def run_dp_controller_process(args: ServerArgs, ipc: IpcNames, parent_pid: int) -> None:
    child_init(args.log_level, "DP")
    ctx = zmq.Context()
    recv_sock = pull_socket(ctx, ipc.scheduler)
    load_sock = pull_socket(ctx, ipc.dp_load)
    ranks = [push_socket(ctx, ipc.scheduler_rank(r)) for r in range(args.dp_size)]
    to_tm = push_socket(ctx, ipc.tokenizer)
    balancer = DPBalancer(args.load_balance_method, args.dp_size)
    dec = decoder(ToController)
    poller = zmq.Poller()
    poller.register(recv_sock, zmq.POLLIN)
    poller.register(load_sock, zmq.POLLIN)
    to_tm.send(ENCODER.encode(ProcReady("dp_controller", info={"dp_size": args.dp_size})))
    logger.info("data-parallel controller: %d ranks, %s", args.dp_size, args.load_balance_method)
    try:
        while parent_alive(parent_pid):
            events = dict(poller.poll(POLL_MS))
            if load_sock in events:
                for raw in drain(load_sock):
                    balancer.report(dec.decode(raw))
            if recv_sock not in events:
                continue
            for raw in drain(recv_sock):
                msg = dec.decode(raw)
                if isinstance(msg, GenerateReq):
                    if msg.data_parallel_rank is not None:
                        rank = msg.data_parallel_rank
                        balancer.sent(rank, len(msg.input_ids))
                    else:
                        rank = balancer.pick(len(msg.input_ids))
                    ranks[rank].send(raw)  # forwarded as it came: no re-encoding
                elif isinstance(msg, AbortReq | ControlReq):
                    for sock in ranks:
                        sock.send(raw)
    except KeyboardInterrupt:
        pass
    finally:
        ctx.destroy(linger=0)
    logger.info("data-parallel controller stopped: the HTTP process is gone")
