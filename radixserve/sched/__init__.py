"""Scheduling: requests, batches, policies, the PrefillAdder and the schedulers."""

from __future__ import annotations

from typing import Any

from radixserve.config import ServerArgs
from radixserve.mem.forward_batch import Runner
from radixserve.sched.kv_manager import KVManager
from radixserve.sched.scheduler import Scheduler
from radixserve.sched.unified_scheduler import UnifiedScheduler


def make_scheduler(args: ServerArgs, runner: Runner, kv: KVManager, **kwargs: Any) -> Scheduler:
    """The scheduler ``args`` asks for (``--scheduler sglang|unified``), over the given runner and KV memory."""
    if args.scheduler == "unified":
        return UnifiedScheduler(args, runner, kv, **kwargs)
    return Scheduler(args, runner, kv, **kwargs)
