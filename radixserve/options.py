"""Options dataclasses as command lines: ``option(default, help, choices, group)`` declares a field
with its help, and ``add_dataclass_cli_args`` / ``dataclass_from_cli_args`` turn a frozen dataclass
of such fields into argparse flags and back (``ServerArgs``, ``RouterArgs``). Also the parser of the
one option syntax two of them share, ``--tenant-weights``."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import field
from typing import Any, get_type_hints


def option(default: Any, help: str, choices: tuple[str, ...] | None = None, group: str = "engine") -> Any:
    return field(default=default, metadata={"help": help, "choices": choices, "group": group})


def add_dataclass_cli_args(cls: type, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One flag per field of an options dataclass built with ``_opt``: ``--field-name``, its help,
    choices and default; ``bool`` fields are switches, tuple fields take one or more values."""
    hints = get_type_hints(cls)
    groups: dict[str, argparse._ArgumentGroup] = {}
    own = set(cls.__dict__.get("__annotations__", {}))
    fields = dataclasses.fields(cls)
    first_of: dict[str, int] = {}
    for i, f in enumerate(fields):
        g = f.metadata.get("group", "engine")
        first_of[g] = min(first_of.get(g, 2 * len(fields)), i if f.name in own else len(fields) + i)
    # groups in the order the class itself declares them, and in a group the class's own fields
    # before those of its bases (``ServerArgs`` before ``QoSOptions``)
    ordered = sorted(fields, key=lambda f: (first_of[f.metadata.get("group", "engine")], f.name not in own))
    for f in ordered:
        if f.name in skip or not f.init:
            continue
        gname = f.metadata.get("group", "engine")
        group = groups.setdefault(gname, parser.add_argument_group(f"{gname} options"))
        flag = "--" + f.name.replace("_", "-")
        help_ = f.metadata.get("help", "")
        hint = hints[f.name]
        if hint is bool:
            # a switch that is on by default needs its --no- form to be turned off at all
            action = argparse.BooleanOptionalAction if f.default is True else "store_true"
            group.add_argument(flag, action=action, default=None, help=help_)
            continue
        nargs = "+" if getattr(hint, "__origin__", None) is tuple else None
        base = _base_type(hint.__args__[0] if nargs else hint)
        default_txt = "" if f.default is None or f.default == () else f" (default: {f.default})"
        group.add_argument(
            flag, type=base, default=None, choices=f.metadata.get("choices"), help=help_ + default_txt,
            metavar=None if f.metadata.get("choices") else f.name.upper(), nargs=nargs,
        )


def dataclass_from_cli_args(cls: Any, ns: argparse.Namespace) -> Any:
    kwargs = {}
    for f in dataclasses.fields(cls):
        v = getattr(ns, f.name, None)
        if v is not None and f.init:
            kwargs[f.name] = tuple(v) if isinstance(v, list) else v
    return cls(**kwargs)


def parse_tenant_weights(spec: str | None) -> dict[str, float]:
    """'a=2,b=1' -> {'a': 2.0, 'b': 1.0}; weights must be > 0."""
    out: dict[str, float] = {}
    for part in (spec or "").split(","):
        if not part.strip():
            continue
        name, sep, w = part.partition("=")
        try:
            weight = float(w)
        except ValueError:
            weight = -1.0
        if not sep or not name.strip() or not weight > 0:
            raise ValueError(f"tenant_weights: expected 'tenant=weight' with weight > 0, got {part.strip()!r}")
        out[name.strip()] = weight
    return out


def _base_type(hint: Any) -> type:
    for t in (int, float, str):
        if hint is t or t in getattr(hint, "__args__", ()):
            return t
    return str
