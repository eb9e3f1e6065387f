"""Tensor parallelism over torch.distributed: the process group, how each rank's share of the
weights is chosen, and the per-step message rank 0 broadcasts to the others.

Megatron-style sharding (``tp`` ranks, rank ``r``):

- q/k/v and gate/up are column-parallel: rank r holds its attention heads (``num_heads / tp`` query
  and ``num_kv_heads / tp`` KV heads, whole GQA groups) and its slice of the MLP's intermediate rows;
- o_proj and down_proj are row-parallel: rank r holds the matching input columns, and their partial
  outputs are summed by an all-reduce (two per layer);
- the embedding is vocabulary-parallel: rank r holds ``ceil(vocab / tp)`` rows (the last padded with
  zeros); a token outside the slice looks up zeros and an all-reduce adds the one real row;
- the LM head uses the same row slice (tied models share it with the embedding): each rank computes
  its slice of the logits and ``gather`` brings them to rank 0, the only rank that samples;
- each rank's KV pool holds its ``num_kv_heads / tp`` heads.

Per step rank 0 broadcasts a ``ForwardBatch`` (as int64: token ids, positions, KV slots, request
rows and lengths) and the request-table writes since the last step; see ``send_step``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from radixserve.mem.forward_batch import (
    ForwardBatch,
    PromptLogprobRows,
    SamplingBatchInfo,
    VerifyRows,
    int64_tensor,
)
from radixserve.model.config import ModelConfig

logger = logging.getLogger(__name__)

# NOTE: an idle server broadcasts nothing, and the other ranks wait in a broadcast meanwhile; gloo
# fails a wait that outlasts the group's timeout (30 min by default). A dead peer is seen at once
# anyway: gloo fails every pending collective when a peer's connection closes.
COLLECTIVE_TIMEOUT = timedelta(days=365)
STORE_CONNECT_TIMEOUT = timedelta(minutes=10)  # how long a rank keeps trying to reach rank 0's store
WAITING_LOG_INTERVAL_S = 30.0

OP_STOP, OP_FORWARD = 0, 1
# op, tokens T, requests B, journal length W, extra logit positions E, verify rows V, draft parents P
HEADER = 7
# Header and payload travel in one broadcast when the payload fits (every decode step up to ~180
# requests): on this 2-core VM each gloo collective costs ~0.3-0.6 ms whatever its size.
INLINE_INTS = 2048


class TPGroup:
    """This process's place in the tensor-parallel group and the collectives the model uses."""

    def __init__(self, rank: int, size: int, backend: str = "gloo") -> None:
        self.rank = rank
        self.size = size
        self.backend = backend
        # gloo moves CPU tensors, NCCL CUDA tensors
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.broken: BaseException | None = None

    def split(self, n: int) -> tuple[int, int]:
        """``[start, end)`` of this rank's share of ``n`` rows (as even as possible)."""
        base, extra = divmod(n, self.size)
        start = self.rank * base + min(self.rank, extra)
        return start, start + base + (self.rank < extra)

    def vocab_range(self, vocab: int) -> tuple[int, int, int]:
        """``(start, end, rows)``: this rank's vocabulary slice, and the padded rows every rank holds
        (equal shapes, which ``gather`` needs)."""
        rows = math.ceil(vocab / self.size)
        start = min(self.rank * rows, vocab)
        return start, min(start + rows, vocab), rows

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t

    def gather_last_dim(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0: every rank's ``t`` concatenated along the last dim; other ranks: ``t`` itself."""
        t = t.contiguous()
        if self.rank != 0:
            dist.gather(t, None, dst=0)
            return t
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.gather(t, parts, dst=0)
        return torch.cat(parts, dim=-1)

    def broadcast_(self, t: torch.Tensor) -> torch.Tensor:
        dist.broadcast(t, src=0)
        return t

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def split_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


def init_tp_group(
    rank: int, size: int, addr: str, *, backend: str = "gloo", alive: Callable[[], bool] | None = None
) -> TPGroup:
    """Join the group: rank 0 serves the TCP store at ``addr`` and waits for every rank to show up
    (calling ``alive`` meanwhile, so a rank that died before joining is an error, not a hang)."""
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed group (one TP engine per process)")
    host, port = split_addr(addr)
    store = dist.TCPStore(host, port, world_size=size, is_master=rank == 0, timeout=STORE_CONNECT_TIMEOUT,
                          wait_for_workers=False)
    store.set(f"radixserve/tp_joined/{rank}", "1")
    if rank == 0:
        keys = [f"radixserve/tp_joined/{r}" for r in range(1, size)]
        last_log = time.monotonic()
        while not store.check(keys):
            if alive is not None and not alive():
                raise RuntimeError("a tensor-parallel rank exited before joining the group")
            if time.monotonic() - last_log > WAITING_LOG_INTERVAL_S:
                last_log = time.monotonic()
                missing = [r for r in range(1, size) if not store.check([f"radixserve/tp_joined/{r}"])]
                logger.warning("waiting for tensor-parallel ranks %s to join at %s (--nnodes, --node-rank, "
                               "--dist-init-addr)", missing, addr)
            time.sleep(0.05)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT)
    logger.info("joined the tensor-parallel group as rank %d of %d (%s, store %s)", rank, size, backend, addr)
    return TPGroup(rank, size, backend)


def check_tp_size(config: ModelConfig, tp_size: int) -> None:
    """Refuse a model whose heads cannot be split evenly over ``tp_size`` ranks."""
    if tp_size == 1:
        return
    if config.qk_norm_whole:
        raise ValueError(f"--tp-size {tp_size}: this model ({config.arch}) normalizes q and k over all heads "
                         "together, which tensor parallelism does not split; run it with --tp-size 1")
    bad = [f"{name} = {n}" for name, n in (("num_attention_heads", config.num_heads),
                                           ("num_key_value_heads", config.num_kv_heads)) if n % tp_size]
    if bad:
        ok = [t for t in range(1, config.num_kv_heads + 1)
              if config.num_kv_heads % t == 0 and config.num_heads % t == 0]
        raise ValueError(f"--tp-size {tp_size} does not divide this model's {' and '.join(bad)}; every rank "
                         f"must hold whole attention and KV heads. --tp-size values this model allows: {ok}")


# --- the per-step message ---------------------------------------------------------------------------
def send_step(tp: TPGroup, fb: ForwardBatch, journal: list[int]) -> None:
    """Rank 0: tell the other ranks what to run (see ``recv_step``)."""
    T, B = fb.num_tokens, fb.batch_size
    extra = fb.extra_logit_positions()  # the other ranks compute these logits too (and sample nothing)
    verify = fb.verify.rows if fb.verify is not None else []  # attended token by token (attention.py)
    # a draft tree's parents, every verify row's in turn (each row has its extend length - 1)
    parents = [p for row in fb.verify.parents for p in row] if fb.verify is not None and fb.verify.parents else []
    body = [fb.input_ids, fb.positions, fb.out_cache_loc, fb.req_pool_indices, fb.seq_lens,
            int64_tensor(fb.extend_prefix_lens), int64_tensor(fb.extend_seq_lens), int64_tensor(journal),
            int64_tensor(extra), int64_tensor(verify), int64_tensor(parents)]
    header = (OP_FORWARD, T, B, len(journal), len(extra), len(verify), len(parents))
    payload = torch.cat([int64_tensor(header), *body])
    n = payload.numel()
    first = torch.zeros(HEADER + INLINE_INTS, dtype=torch.int64)
    first[: min(n, first.numel())] = payload[: first.numel()]
    tp.broadcast_(first.to(tp.device))
    if n > first.numel():
        tp.broadcast_(payload[first.numel() :].to(tp.device))


def send_stop(tp: TPGroup) -> None:
    msg = torch.zeros(HEADER + INLINE_INTS, dtype=torch.int64)
    msg[0] = OP_STOP
    tp.broadcast_(msg.to(tp.device))


def recv_step(tp: TPGroup) -> tuple[ForwardBatch, torch.Tensor] | None:
    """Ranks > 0: the next step's batch (sampling left greedy: only rank 0 samples) and the
    request-table journal to replay first; None when rank 0 stops."""
    first = tp.broadcast_(torch.empty(HEADER + INLINE_INTS, dtype=torch.int64, device=tp.device)).cpu()
    op, T, B, W, E, V, P = first[:HEADER].tolist()
    if op == OP_STOP:
        return None
    n = 3 * T + 4 * B + W + E + V + P
    body = first[HEADER : HEADER + n]
    if n > INLINE_INTS:
        rest = tp.broadcast_(torch.empty(n - INLINE_INTS, dtype=torch.int64, device=tp.device)).cpu()
        body = torch.cat([body, rest])
    ids, pos, loc, rows, seq_lens, prefix, ext, journal, extra, verify, flat = body.split([T, T, T, B, B, B, B, W, E, V, P])
    # the extra positions (prompt logprobs and drafts alike) travel as prompt-logprob rows; the verify
    # rows only say which rows attention takes token by token
    ext_lens = ext.tolist()
    parents: list[list[int]] | None = None
    if P:
        flat_parents, parents = flat.tolist(), []
        for row in verify.tolist():
            parents.append(flat_parents[: ext_lens[row] - 1])
            del flat_parents[: ext_lens[row] - 1]
    fb = ForwardBatch(ids, pos, loc, rows, seq_lens, prefix.tolist(), ext_lens, SamplingBatchInfo.greedy(B),
                      prompt_logprobs=PromptLogprobRows(extra.tolist()) if E else None,
                      verify=VerifyRows(verify.tolist(), [], [], parents=parents) if V else None)
    return fb, journal
