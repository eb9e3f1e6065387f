"""The KV pools and the scheduler a loaded model serves with: the pool's size from the options and
the memory, the sliding-window layers' own pages where they can have them, the KV tier, the
grammar compiler. ``Engine`` and the server's scheduler process build theirs here."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from radixserve.config import ServerArgs
from radixserve.grammar import GrammarCompiler
from radixserve.mem.cache_events import CacheEvent
from radixserve.mem.kv_pool import JournaledReqToTokenPool, ReqToTokenPool
from radixserve.model.model_runner import ModelRunner
from radixserve.sched.build import build_kv, request_slots
from radixserve.sched.build import build_scheduler as build_sched
from radixserve.sched.core import SchedulerCore
from radixserve.sched.tier_setup import build_hicache


def system_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def kv_pool_tokens(args: ServerArgs, bytes_per_token: int, context_len: int) -> int:
    """Pool size in tokens: --max-total-tokens, or --mem-fraction-static of system memory."""
    if args.max_total_tokens is not None:
        tokens = args.max_total_tokens
    else:
        tokens = int(system_memory_bytes() * args.mem_fraction_static) // bytes_per_token
        # NOTE: no point in more than enough for every request slot at full context.
        tokens = min(tokens, request_slots(args) * context_len)
    tokens -= tokens % args.page_size
    if tokens < args.page_size:
        raise ValueError(f"KV pool of {tokens} tokens is too small (page_size {args.page_size})")
    return tokens


def local_window(args: ServerArgs, runner: ModelRunner) -> int | None:
    """The window of the model's sliding layers when it also has global ones, and they can have KV
    slots of their own (mem/window_kv.py): not where KV leaves the pool by slot for every layer at
    once (the KV tier, prefill/decode transfers), nor under tensor parallelism or with a draft model
    (whose tables are not kept in those slots), nor with ``--disable-hybrid-swa-memory``. Elsewhere
    they share the global layers' slots and read only their window."""
    c = runner.model_config
    if not c.sliding_layers or c.whole_window or runner.draft or args.tp_size > 1:
        return None
    if args.disable_hybrid_swa_memory or args.enable_hierarchical_cache or args.disaggregation_mode != "null":
        return None
    return c.sliding_window


def grammar_compiler(runner: ModelRunner) -> GrammarCompiler:
    """The structured-output compiler for the runner's model. Its warm-up builds llguidance's
    tokenizer from the model's (``ModelRunner.tokenizer``, built then if it was not yet)."""
    return GrammarCompiler(lambda: runner.tokenizer.backend.to_str(), runner.model_config.vocab_size,
                           list(runner.stop_token_ids))


def build_scheduler(args: ServerArgs, runner: ModelRunner, context_len: int,
                    event_sink: Callable[[CacheEvent], None] | None = None, dp_rank: int | None = None,
                    grammars: GrammarCompiler | None = None) -> SchedulerCore:
    """Size the pools, attach them to the runner, and build the scheduler over them (``event_sink``:
    the radix cache's events, ``sched.build.build_kv``), with the KV tier behind the prefix cache if
    ``--enable-hierarchical-cache`` (``dp_rank``: whose store it is). ``grammars``: a compiler whose
    warm-up the caller starts (a scheduler process: once it has reported ready); by default one is
    built and warmed up here.

    ``--overlap-schedule auto`` is the normal loop here: on a CPU the forward thread would share the
    cores with the model's own threads (the option's help has the figures)."""
    if args.overlap_schedule == "auto":
        args = args.replace(overlap_schedule="off")
    runner.use_kv_cache_dtype(args.kv_cache_dtype)
    runner.use_draft(args)
    bpt = runner.kv_bytes_per_token()  # (with a draft model's KV, which has the same slots)  # under tensor parallelism: this rank's KV heads only
    # NOTE: the tensor-parallel ranks of one machine share its memory, as data-parallel ranks do: the
    # --mem-fraction-static budget holds the same tokens whatever the tp size (each rank 1/tp of each).
    total = kv_pool_tokens(args, bpt * args.tp_ranks_per_node, context_len)
    max_reqs = request_slots(args)
    print(
        f"[radixserve] KV cache: {total} tokens x {bpt} B/token ({runner.kv_format.name}) = "
        f"{total * bpt / 2**30:.2f} GiB "
        f"({'--max-total-tokens' if args.max_total_tokens else f'--mem-fraction-static {args.mem_fraction_static}'}), "
        f"page size {args.page_size}, {max_reqs} request slots, context {context_len}"
        + (f" (per tensor-parallel rank: 1/{args.tp_size} of the KV heads)" if args.tp_size > 1 else ""),
        file=sys.stderr,
    )
    # other TP ranks replay this table's writes; KV behind a whole-model window is freed (not for a draft)
    local = local_window(args, runner)
    kv = build_kv(args, total, context_len, pool_cls=JournaledReqToTokenPool if args.tp_size > 1 else ReqToTokenPool,
                  event_sink=event_sink, window=None if runner.draft else runner.model_config.whole_window,
                  local_window=local)
    if local:
        print(f"[radixserve] KV cache: the sliding-window layers keep a window ({local}) per request and per "
              "cached prefix end, in slots of their own", file=sys.stderr)
    pool = runner.make_kv_pool(total, args.page_size)
    runner.attach_pools(pool, kv.req_to_token_pool)
    if args.enable_hierarchical_cache:
        assert kv.prefix_tree is not None  # the options refuse the tier without a radix cache
        kv.attach_tier(build_hicache(args, kv.prefix_tree, kv.allocator, pool, runner.kv_identity(),
                                     runner.kv_written, dp_rank))
    if grammars is None:
        grammars = grammar_compiler(runner)
        grammars.warm_up()
    return build_sched(
        args, runner, kv, context_len=context_len, vocab_size=runner.model_config.vocab_size,
        eos_token_ids=list(runner.stop_token_ids),
        detokenize=lambda ids: runner.tokenizer.decode(ids, True), grammar_compiler=grammars,
    )
