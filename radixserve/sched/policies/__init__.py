"""Waiting-queue orders (``--schedule-policy``): ``base`` (the interface), ``registry`` (the one
registry, plugins), and one module per family of policies."""

from radixserve.sched.policies.base import PolicyContext, SchedulePolicy
from radixserve.sched.policies.registry import get_policy, make_policy, policy_names, register_policy

__all__ = ["PolicyContext", "SchedulePolicy", "get_policy", "make_policy", "policy_names", "register_policy"]
