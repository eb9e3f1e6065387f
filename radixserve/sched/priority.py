"""Request priorities (SGLang's rules, shared by both schedulers, the policies and preemption).

- ``--enable-priority-scheduling``: the priority orders the waiting queue (arrival time breaks
  ties); a larger value is more important, a smaller one with
  ``--schedule-low-priority-values-first``. A request without a priority gets
  ``--default-priority-value``, or else the least important value there is (SGLang's
  ``sys.maxsize`` / ``-sys.maxsize - 1``).
- Under ``--scheduler unified`` priority means vLLM's ``--scheduling-policy priority``: a smaller
  value is more important and a missing priority is 0.

Everything compares ``rank`` (smaller is more important); the least important of a group is the
largest rank, the latest arrival among equals (``least_important``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixserve.config.scheduling import SchedulingOptions
    from radixserve.sched.req import Req


@dataclass(frozen=True)
class PrioritySettings:
    enabled: bool = False
    low_values_first: bool = False
    default: int = 0
    preemption_threshold: int = 10
    abort_when_disabled: bool = False

    @classmethod
    def from_args(cls, args: SchedulingOptions) -> PrioritySettings:
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

    def least_important(self, reqs: Sequence[Req]) -> int:
        """The index of the least important of ``reqs`` (the latest arrival among equals)."""
        rank = self.rank
        return max(range(len(reqs)), key=lambda j: (rank(reqs[j]), reqs[j].arrival_time, j))
