"""The policy plugin interface, policy construction and live switching.

A policy is a class with a ``name`` and ``order(waiting, ctx) -> list[Req]`` (``policy.py``).
Optional hooks, called when defined (the stable interface):

- ``configure(self, args: ServerArgs, **params)``: after construction, with the server arguments
  and the extra parameters of ``POST /set_schedule_policy``; raise ``ValueError`` on a bad one.
- ``on_batch(self, batch: ScheduleBatch, sched: Scheduler)``: after each forward step's results
  were processed (e.g. to charge counters; ``fairness.py``).
- ``cache_aware = True``: it reads prefix matches of the waiting requests.

Naming a policy: a registered name (``@register_policy``; built-in, or from a file given with
``--policy-plugin path.py[,more.py]``), or ``module.path:ClassName`` (imported; registration not
needed). Aging, the starvation counter and the victim rules apply to any policy (``aging.py``).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from radixserve.config import ServerArgs
from radixserve.sched.policy import _REGISTRY, SchedulePolicy, get_policy

if TYPE_CHECKING:
    from radixserve.sched.scheduler import Scheduler

# ServerArgs fields POST /set_schedule_policy may change (no memory or process layout among them)
LIVE_FIELDS = frozenset({
    "schedule_policy", "lpm_fallback_threshold", "in_batch_prefix_caching_check_threshold",
    "in_batch_prefix_caching_deprioritize_threshold", "priority_aging_rate", "priority_aging_horizon",
    "sjf_output_weight", "deadline_admission", "tenant_weights", "vtc_input_weight", "vtc_output_weight",
    "max_preemptions_per_request", "retract_victim_policy", "starvation_threshold", "queue_timeout",
    "max_queued_requests", "prefill_max_requests", "enable_priority_scheduling",
    "priority_scheduling_preemption_threshold",
})
_loaded_files: set[str] = set()


def load_plugin_files(spec: str | None) -> None:
    """Import each comma-separated file once; its ``@register_policy`` classes become names."""
    for raw in (spec or "").split(","):
        path = raw.strip()
        if not path or str(Path(path).resolve()) in _loaded_files:
            continue
        resolved = Path(path).resolve()
        if not resolved.is_file():
            raise ValueError(f"--policy-plugin: no such file {path!r}")
        mod_name = f"radixserve_policy_plugin_{resolved.stem}_{len(_loaded_files)}"
        mspec = importlib.util.spec_from_file_location(mod_name, resolved)
        assert mspec is not None and mspec.loader is not None
        module = importlib.util.module_from_spec(mspec)
        sys.modules[mod_name] = module
        mspec.loader.exec_module(module)
        _loaded_files.add(str(resolved))


def policy_class(name: str) -> type[SchedulePolicy]:
    if ":" in name and name not in _REGISTRY:
        mod, _, cls_name = name.partition(":")
        try:
            cls = getattr(importlib.import_module(mod), cls_name)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"cannot load schedule policy {name!r}: {e}") from None
        if not (isinstance(cls, type) and callable(getattr(cls, "order", None))):
            raise ValueError(f"{name!r} is not a policy class (it needs an order(waiting, ctx) method)")
        return cls  # type: ignore[no-any-return]
    return type(get_policy(name))


def make_policy(args: ServerArgs, **params: Any) -> SchedulePolicy:
    load_plugin_files(args.policy_plugin)
    policy = policy_class(args.schedule_policy)()
    configure = getattr(policy, "configure", None)
    if configure is not None:
        configure(args, **params)
    elif params:
        raise ValueError(f"schedule policy {args.schedule_policy!r} takes no parameters {sorted(params)}")
    return policy


def set_schedule_policy(sched: Scheduler, params: dict[str, Any]) -> dict[str, Any]:
    """Swap the scheduler's policy and/or its parameters between steps; queued and running requests
    stay. ``params``: ServerArgs fields in ``LIVE_FIELDS``, the rest go to the policy's ``configure``.
    Returns ``{"success": True, "schedule_policy": ...}`` or ``{"success": False, "message": ...}``."""
    from radixserve.sched.priority import PrioritySettings  # noqa: PLC0415 (priority imports scheduler types)

    fields = {k: v for k, v in params.items() if k in LIVE_FIELDS}
    extra = {k: v for k, v in params.items() if k not in LIVE_FIELDS}
    try:
        if sched.args.scheduler == "unified" and "schedule_policy" in fields:
            raise ValueError("--scheduler unified orders by --scheduling-policy; it has no --schedule-policy")
        args = sched.args.replace(**fields)
        policy = make_policy(args, **extra)
    except (ValueError, TypeError) as e:
        return {"success": False, "message": str(e)}
    sched.args = args
    sched.policy = policy
    sched.prio = PrioritySettings.from_args(args)
    return {"success": True, "schedule_policy": args.schedule_policy,
            "params": {k: getattr(args, k) for k in sorted(fields)} | extra}
