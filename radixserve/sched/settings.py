"""The settings the scheduler's managers read, and their live switch.

``SchedSettings`` holds the server arguments, the priority settings derived from them and the
policy object. The managers receive the same ``SchedSettings`` and read it on every use, so
``POST /set_schedule_policy`` (``switch``) changes them all at once, between two steps.

The priority rules are ``priority.py``'s.
"""

from __future__ import annotations

from typing import Any

from radixserve.config import ServerArgs
from radixserve.sched.policies.base import SchedulePolicy
from radixserve.sched.policies.registry import make_policy
from radixserve.sched.priority import PrioritySettings

# ServerArgs fields POST /set_schedule_policy may change (no memory or process layout among them)
LIVE_FIELDS = frozenset({
    "schedule_policy", "lpm_fallback_threshold", "in_batch_prefix_caching_check_threshold",
    "in_batch_prefix_caching_deprioritize_threshold", "priority_aging_rate", "priority_aging_horizon",
    "sjf_output_weight", "deadline_admission", "tenant_weights", "vtc_input_weight", "vtc_output_weight",
    "max_preemptions_per_request", "retract_victim_policy", "starvation_threshold", "queue_timeout",
    "max_queued_requests", "prefill_max_requests", "enable_priority_scheduling",
    "priority_scheduling_preemption_threshold",
})


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
