"""The one registry of schedule policies, plugins, and policy construction.

A policy is a class with a ``name`` and ``order(waiting, ctx) -> list[Req]`` (``base.py``).
Optional hooks, called when defined (the stable interface):

- ``configure(self, args: ServerArgs, **params)``: after construction, with the server arguments
  and the extra parameters of ``POST /set_schedule_policy``; raise ``ValueError`` on a bad one.
- ``on_batch(self, batch: ScheduleBatch)``: after each forward step's results were processed
  (e.g. to charge counters; ``vtc.py``).
- ``cache_aware = True``: it reads prefix matches of the waiting requests.

The built-in policies are listed in ``BUILTIN`` below. A plugin adds its own with
``@register_policy`` in a file given with ``--policy-plugin path.py[,more.py]``; a policy can also
be named ``module.path:ClassName`` (imported; registration not needed). Aging, the starvation
counter and the victim rules apply to any policy (``ordering.py``).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from radixserve.config import ServerArgs
from radixserve.sched.policies.base import SchedulePolicy
from radixserve.sched.policies.edf import EarliestDeadlineFirst
from radixserve.sched.policies.lpm import DFSWeight, LongestPrefixMatch
from radixserve.sched.policies.simple import FCFS, LongestOutputFirst, RandomOrder
from radixserve.sched.policies.sjf import ShortestJobFirst
from radixserve.sched.policies.vtc import VirtualTokenCounter

BUILTIN: tuple[type[SchedulePolicy], ...] = (
    FCFS, LongestPrefixMatch, DFSWeight, LongestOutputFirst, RandomOrder, ShortestJobFirst,
    EarliestDeadlineFirst, VirtualTokenCounter,
)
_REGISTRY: dict[str, type[SchedulePolicy]] = {cls.name: cls for cls in BUILTIN}
_loaded_files: set[str] = set()


def register_policy(cls: type[SchedulePolicy]) -> type[SchedulePolicy]:
    """Class decorator for plugin files: makes ``cls.name`` a ``--schedule-policy`` value."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    _REGISTRY[cls.name] = cls
    return cls


def get_policy(name: str) -> SchedulePolicy:
    try:
        return _REGISTRY[name]()
    except KeyError:
        raise ValueError(f"unknown schedule policy {name!r}; choose from {sorted(_REGISTRY)}") from None


def policy_names() -> list[str]:
    return sorted(_REGISTRY)


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
        return cls
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
