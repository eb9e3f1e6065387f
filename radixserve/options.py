"""Options dataclasses as command lines: ``option(default, help, choices, group)`` declares a field
with its help, and ``add_dataclass_cli_args`` / ``dataclass_from_cli_args`` turn a frozen dataclass
of such fields into argparse flags and back (``ServerArgs``, ``RouterArgs``). A field may have other
names (SGLang's and vLLM's for the same option): ``aliases`` are more flags for it, ``switches`` are
flags that set it to one value (``--disable-overlap-schedule`` is ``--overlap-schedule off``), and
``alias_kwargs`` maps both spellings of keyword arguments onto the field. Also the parser of the
one option syntax two of them share, ``--tenant-weights``."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import field
from typing import Any, get_type_hints


def option(default: Any, help: str, choices: tuple[str, ...] | None = None, group: str = "engine", *,
           aliases: tuple[str, ...] = (), switches: dict[str, Any] | None = None) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices, "group": group,
                                            "aliases": aliases, "switches": switches or {}})


def not_positive(options: Any, name: str, allow_none: bool = True) -> list[str]:
    """The error of an option that must be a positive integer (or None, if allowed), if any."""
    v = getattr(options, name)
    if (v is None and allow_none) or (isinstance(v, int) and v > 0):
        return []
    return [f"{name} must be a positive integer, got {v!r}"]


def _kwarg(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def alias_kwargs(cls: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with every other name of a field turned into the field's own: an alias carries
    its value over, a switch that is on sets the field to its value (and wins over the field), a
    switch that is off is dropped. Giving a field and its alias different values is an error."""
    out = dict(kwargs)
    for f in dataclasses.fields(cls):
        for flag in f.metadata.get("aliases", ()):
            name = _kwarg(flag)
            if name in out:
                v = out.pop(name)
                if f.name in out and out[f.name] != v:
                    raise ValueError(f"{name} and {f.name} are the same option; got {v!r} and {out[f.name]!r}")
                out[f.name] = v
        for flag, value in f.metadata.get("switches", {}).items():
            if out.pop(_kwarg(flag), None):
                out[f.name] = value
    return out


def add_dataclass_cli_args(cls: type, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One flag per field of an options dataclass built with ``_opt``: ``--field-name``, its help,
    choices and default; ``bool`` fields are switches, tuple fields take one or more values."""
    hints = get_type_hints(cls)
    groups: dict[str, argparse._ArgumentGroup] = {}
    # fields in the order their classes declare them, the class's own before its bases' (an
    # options class made of areas lists the areas in the order it names them), grouped by --help
    # section in the order the sections first appear
    declared = [name for k in cls.__mro__ for name in k.__dict__.get("__annotations__", {})]
    by_name = {f.name: f for f in dataclasses.fields(cls)}
    fields = [by_name[n] for n in dict.fromkeys(declared) if n in by_name]
    section = {g: i for i, g in reversed(list(enumerate(f.metadata.get("group", "engine") for f in fields)))}
    ordered = sorted(fields, key=lambda f: section[f.metadata.get("group", "engine")])
    for f in ordered:
        if f.name in skip or not f.init:
            continue
        gname = f.metadata.get("group", "engine")
        group = groups.setdefault(gname, parser.add_argument_group(f"{gname} options"))
        flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
        help_ = f.metadata.get("help", "")
        hint = hints[f.name]
        if hint is bool:
            # a switch that is on by default needs its --no- form to be turned off at all
            action = argparse.BooleanOptionalAction if f.default is True else "store_true"
            group.add_argument(*flags, dest=f.name, action=action, default=None, help=help_)
            continue
        nargs = "+" if getattr(hint, "__origin__", None) is tuple else None
        base = _base_type(hint.__args__[0] if nargs else hint)
        default_txt = "" if f.default is None or f.default == () else f" (default: {f.default})"
        group.add_argument(
            *flags, dest=f.name, type=base, default=None, choices=f.metadata.get("choices"), help=help_ + default_txt,
            metavar=None if f.metadata.get("choices") else f.name.upper(), nargs=nargs,
        )
        for flag, value in f.metadata.get("switches", {}).items():
            group.add_argument(flag, dest=_kwarg(flag), action="store_true", default=None,
                               help=f"Same as --{f.name.replace('_', '-')} {value}.")


def dataclass_from_cli_args(cls: Any, ns: argparse.Namespace) -> Any:
    kwargs = {}
    for f in dataclasses.fields(cls):
        v = getattr(ns, f.name, None)
        if v is not None and f.init:
            kwargs[f.name] = tuple(v) if isinstance(v, list) else v
        for flag in f.metadata.get("switches", {}):
            if getattr(ns, _kwarg(flag), None):
                kwargs[_kwarg(flag)] = True
    return cls(**alias_kwargs(cls, kwargs))


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
