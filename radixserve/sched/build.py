"""One function builds a scheduler and its KV memory from the options: the request-slot pool, the
KV slot allocator, the prefix cache, the ``KVManager``, the managers (``parts.py``) and the batch
builder ``--scheduler`` names. The engine, the simulator and the test doubles all build through it, so they cannot drift
apart (the KV tensors themselves are the model runner's: the engine attaches them afterwards)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from radixserve.config import ServerArgs
from radixserve.config.scheduling import SchedulingOptions
from radixserve.mem.allocator import TokenToKVPoolAllocator
from radixserve.mem.base_cache import BasePrefixCache, ChunkCache
from radixserve.mem.cache_events import CacheEvent
from radixserve.mem.forward_batch import Runner
from radixserve.mem.kv_pool import ReqToTokenPool
from radixserve.mem.radix_cache import RadixCache
from radixserve.mem.window_kv import WindowKV
from radixserve.sched.core import SchedulerCore
from radixserve.sched.grammar_queue import Compiler
from radixserve.sched.kv_manager import KVManager
from radixserve.sched.parts import BatchBuilder, build_parts
from radixserve.sched.scheduler import PrefillFirst
from radixserve.sched.unified_scheduler import TokenBudget

DEFAULT_MAX_RUNNING_REQUESTS = 256  # request slots without --max-running-requests (SGLang's CPU default)


def request_slots(args: SchedulingOptions) -> int:
    """Request slots in the pool: ``--max-running-requests`` (vLLM's ``--max-num-seqs``), else 256
    (SGLang's default on CPU and vLLM's alike)."""
    return args.max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS


def build_kv(
    args: ServerArgs, total_tokens: int, context_len: int, *,
    pool_cls: Callable[[int, int], ReqToTokenPool] = ReqToTokenPool, max_reqs: int | None = None,
    event_sink: Callable[[CacheEvent], None] | None = None, window: int | None = None,
    local_window: int | None = None,
) -> KVManager:
    """The request-slot pool (``pool_cls``), the allocator over ``total_tokens`` KV slots and the
    prefix cache ``--disable-radix-cache`` / ``--radix-eviction-policy`` ask for; ``event_sink``
    receives the radix cache's events (``--cache-events-port``, the simulator's router); ``window``:
    the model's whole-model sliding window (``ModelConfig.whole_window``: KV behind it is freed);
    ``local_window``: the window of sliding layers among global ones, which then get slots of their
    own (``mem/window_kv.py``)."""
    r2t = pool_cls(max_reqs if max_reqs is not None else request_slots(args), context_len)
    allocator = TokenToKVPoolAllocator(total_tokens, args.page_size)
    cache: BasePrefixCache = (
        ChunkCache(r2t, allocator) if args.disable_radix_cache
        else RadixCache(r2t, allocator, args.radix_eviction_policy, event_sink)
    )
    window_kv = WindowKV(allocator.num_pages, args.page_size, local_window) if local_window else None
    return KVManager(r2t, allocator, cache, window, window_kv)


def build_scheduler(
    args: ServerArgs, runner: Runner, kv: KVManager, *, context_len: int, vocab_size: int | None = None,
    eos_token_ids: Sequence[int] = (), detokenize: Callable[[list[int]], str] | None = None,
    clock: Callable[[], float] = time.monotonic, grammar_compiler: Compiler | None = None,
) -> SchedulerCore:
    """A ``SchedulerCore`` over the managers and the builder ``--scheduler`` names (sglang:
    ``PrefillFirst``, unified: ``TokenBudget``)."""
    parts = build_parts(args, runner, kv, context_len=context_len, eos_token_ids=eos_token_ids,
                        detokenize=detokenize, clock=clock, grammar_compiler=grammar_compiler)
    builder: BatchBuilder = TokenBudget(parts) if args.scheduler == "unified" else PrefillFirst(parts)
    return SchedulerCore(parts, builder, context_len=context_len, vocab_size=vocab_size, eos_token_ids=eos_token_ids)
