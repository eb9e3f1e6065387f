"""Scheduling: requests, batches, policies, the managers and the two schedulers (docs/architecture.md)."""

from radixserve.sched.build import build_kv, build_scheduler, request_slots
from radixserve.sched.core import SchedulerCore
from radixserve.sched.scheduler import Scheduler
from radixserve.sched.unified_scheduler import UnifiedScheduler

__all__ = ["Scheduler", "SchedulerCore", "UnifiedScheduler", "build_kv", "build_scheduler", "request_slots"]
