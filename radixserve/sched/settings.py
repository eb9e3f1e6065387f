"""The settings the scheduler's managers read, and their live switch.

``SchedSettings`` holds the server arguments, the priority settings derived from them and the
policy object. The managers receive the same ``SchedSettings`` and read it on every use, so
``POST /set_schedule_policy`` (``switch``) changes them all at once, between two steps.

Priorities (SGLang's rules, shared by both schedulers):
- ``--enable-priority-scheduling``: the priority orders the waiting queue (arrival time breaks
  ties); a larger value is more important, a smaller one with
  ``--schedule-low-priority-values-first``. A request without a priority gets
  ``--default-priority-value``, or else the least important value there is (SGLang's
  ``sys.maxsize`` / ``-sys.maxsize - 1``).
- Under ``--scheduler unified`` priority means vLLM's ``--scheduling-policy priority``: a smaller
  value is more important and a missing priority is 0.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from radixserve.config import ServerArgs
from radixserve.sched.policies.base import SchedulePolicy
from radixserve.sched.policies.registry import make_policy
from radixserve.sched.req import Req

# ServerArgs fields POST /set_schedule_policy may change (no memory or process layout among them)
LIVE_FIELDS = frozenset({
    "schedule_policy", "lpm_fallback_threshold", "in_batch_prefix_caching_check_threshold",
    "in_batch_prefix_caching_deprioritize_threshold", "priority_aging_rate", "priority_aging_horizon",
    "sjf_output_weight", "deadline_admission", "tenant_weights", "vtc_input_weight", "vtc_output_weight",
    "max_preemptions_per_request", "retract_victim_policy", "starvation_threshold", "queue_timeout",
    "max_queued_requests", "prefill_max_requests", "enable_priority_scheduling",
    "priority_scheduling_preemption_threshold",
})


@dataclass(frozen=True)
class PrioritySettings:
    enabled: bool = False
    low_values_first: bool = False
    default: int = 0
    preemption_threshold: int = 10
    abort_when_disabled: bool = False

    @classmethod
    def from_args(cls, args: ServerArgs) -> PrioritySettings:
        if args.scheduler == "unified":  # vLLM: smaller is more important, 0 by default
            low, enabled = True, args.scheduling_policy == "priority"
            default = 0 if args.default_priority_value is None else args.default_priority_value
        else:
            low, enabled = args.schedule_low_priority_values_first, args.enable_priority_scheduling
            if args.default_priority_value is not None:
                default = args.default_priority_value
            else:  # SGLang: the least important value there is
                default = sys.maxsize if low else -sys.maxsize - 1
        return cls(enabled, low, default, args.priority_scheduling_preemption_threshold,
                   args.abort_on_priority_when_disabled)

    def rank(self, req: Req) -> int:
        """Smaller is more important; 0 for everyone when priorities are off."""
        if not self.enabled:
            return 0
        p = self.default if req.priority is None else req.priority
        return p if self.low_values_first else -p


class SchedSettings:
    def __init__(self, args: ServerArgs, policy: SchedulePolicy | None = None) -> None:
        self.args = args
        self.policy = policy if policy is not None else make_policy(args)
        self.prio = PrioritySettings.from_args(args)

    def switch(self, params: dict[str, Any]) -> dict[str, Any]:
        """Swap the policy and/or its parameters; queued and running requests stay. ``params``:
        ServerArgs fields in ``LIVE_FIELDS``, the rest go to the policy's ``configure``. Returns
        ``{"success": True, "schedule_policy": ...}`` or ``{"success": False, "message": ...}``."""
        fields = {k: v for k, v in params.items() if k in LIVE_FIELDS}
        extra = {k: v for k, v in params.items() if k not in LIVE_FIELDS}
        try:
            if self.args.scheduler == "unified" and "schedule_policy" in fields:
                raise ValueError("--scheduler unified orders by --scheduling-policy; it has no --schedule-policy")
            args = self.args.replace(**fields)
            policy = make_policy(args, **extra)
        except (ValueError, TypeError) as e:
            return {"success": False, "message": str(e)}
        self.args = args
        self.policy = policy
        self.prio = PrioritySettings.from_args(args)
        return {"success": True, "schedule_policy": args.schedule_policy,
                "params": {k: getattr(args, k) for k in sorted(fields)} | extra}
