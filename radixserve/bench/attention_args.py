"""``radixserve bench attention``'s options, apart from the benchmark so that building the CLI's
parser (every ``radixserve`` command, ``serve`` included) does not import torch."""

from __future__ import annotations

import argparse


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-sizes", default="1,32,64,128",
                   help="Comma-separated numbers of decoding requests.")
    p.add_argument("--contexts", default="256,1024",
                   help="Comma-separated context lengths: tokens each request attends to (its new one included).")
    p.add_argument("--backends", default="torch_native,cpu_paged",
                   help="Comma-separated attention backends; the first is the baseline of the speed-up column. "
                        "NAME@KV reads a pool stored as --kv-cache-dtype KV (e.g. cpu_paged,cpu_paged@int8: the "
                        "kernel over a bfloat16 pool and over an int8 one, alternated in the same run).")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                   help="dtype of q and of the KV pool (bfloat16 is what --dtype auto picks on this CPU).")
    p.add_argument("--page-size", type=int, default=16,
                   help="Tokens per KV page: each request's pages are scattered over the pool at random.")
    p.add_argument("--pool-tokens", type=int, default=0,
                   help="KV slots per layer of the pool the batch's pages are scattered over; 0: only as many as "
                        "the batch needs. A server sizes its pool from memory (radixserve serve logs it: about 160k "
                        "slots on a 24 GiB machine), and pages scattered over that much memory cost more TLB "
                        "misses than a pool just large enough for the batch.")
    p.add_argument("--num-heads", type=int, default=None, help="Query heads; unset: the model's.")
    p.add_argument("--num-kv-heads", type=int, default=None, help="KV heads; unset: the model's.")
    p.add_argument("--head-dim", type=int, default=None, help="Head dimension; unset: the model's.")
    p.add_argument("--model-path", default=None,
                   help="Model whose attention shape is used; unset: the bundled SmolLM2 (9 heads, 3 KV heads, "
                        "head_dim 64). Only its config is read.")
    p.add_argument("--iters", type=int, default=30, help="Timed layer calls per backend per round (one layer each).")
    p.add_argument("--max-pool-mib", type=int, default=1536,
                   help="Most KV pool memory per configuration: the pool has the model's number of layers, or "
                        "fewer when they would not fit in this.")
    p.add_argument("--rounds", type=int, default=3, help="Alternated rounds per backend.")
    p.add_argument("--stat", default="median", choices=["median", "min"],
                   help="Figure printed per backend over all its timed calls: the median, or the minimum (steadier "
                        "on a shared machine, where other work preempts some calls).")
    p.add_argument("--stream-mb", type=int, default=512, help="Size of each tensor of the STREAM-style copy, MiB.")
    p.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads; unset: torch's choice.")
    p.add_argument("--output", default=None, help="Write the results as JSON here.")
