"""``radixserve bench radix``'s options, apart from the benchmark so that building the CLI's parser
does not import torch (through the KV pool)."""

from __future__ import annotations

import argparse


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=1 << 20, help="KV slots in the pool; the trace fills it.")
    p.add_argument("--page-size", type=int, default=1, help="Tokens per KV page.")
    p.add_argument("--prefixes", type=int, default=64, help="Distinct system prompts the requests share.")
    p.add_argument("--rounds", type=int, default=3, help="Alternated rounds per allocator (the best is kept).")
    p.add_argument("--seed", type=int, default=0, help="Seed of the trace.")
    p.add_argument("--output", default=None, metavar="FILE", help="Also write the figures as JSON here.")
