"""``ServerArgs`` refuses a bad combination of options at construction, naming every problem at
once (one group of checks per area), and never with anything but a ``ValueError``."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from radixserve.config import ServerArgs
from radixserve.router.config import RouterArgs


@pytest.mark.parametrize("kw, says", [
    ({"page_size": 0}, "page_size must be a positive integer"),
    ({"page_size": 0, "chunked_prefill_size": 64}, "page_size must be a positive integer"),  # no division by 0
    ({"chunked_prefill_size": 7, "page_size": 4}, "chunked_prefill_size must be a multiple of page_size"),
    ({"chat_template": "no-such-file"}, "neither a file nor a Jinja template"),
    ({"disaggregation_mode": "prefill", "disable_radix_cache": True}, "cannot be used with --disable-radix-cache"),
    ({"port": 70000}, "port must be in [0, 65535]"),
    ({"dp_size": 0}, "dp_size must be a positive integer"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be a positive integer"),
    ({"scheduler": "unified", "schedule_policy": "lpm"}, "--scheduler unified takes --scheduling-policy"),
    ({"queue_timeout": -1.0}, "queue_timeout must be > 0 seconds"),
    ({"priority_aging_rate": -2}, "priority_aging_rate must be a number >= 0"),
    ({"tpot_headroom": 0}, "tpot_headroom must be in (0, 1]"),
])
def test_each_group_of_checks_refuses_its_options(kw: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError, match="invalid server arguments: .*" + re.escape(says)):
        ServerArgs(**kw)


def test_every_problem_is_named_at_once() -> None:
    with pytest.raises(ValueError) as e:
        ServerArgs(page_size=0, port=-1, queue_timeout=0.0, max_running_requests=-3)
    msg = str(e.value)
    for part in ("page_size", "port must be", "queue_timeout", "max_running_requests"):
        assert part in msg


def test_defaults_are_valid() -> None:
    assert ServerArgs().page_size == 1


def test_each_field_belongs_to_one_area() -> None:
    """``ServerArgs`` is the union of its areas: a name declared by two areas would silently be
    one field, so none may be; and ``ServerArgs`` adds no field of its own."""
    areas = [k for k in ServerArgs.__mro__[1:] if dataclasses.is_dataclass(k)]
    assert {k.__name__ for k in areas} == {"ModelOptions", "MemoryOptions", "SchedulingOptions", "QoSOptions",
                                           "ServingOptions", "DisaggOptions", "SpeculativeOptions"}
    declared = [name for k in areas for name in k.__dict__.get("__annotations__", {})]
    assert len(declared) == len(set(declared))
    assert set(declared) == {f.name for f in dataclasses.fields(ServerArgs)}
    args = ServerArgs(page_size=4)
    assert all(isinstance(args, k) for k in areas)


def _cli(*argv: str) -> ServerArgs:
    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    return ServerArgs.from_cli_args(p.parse_args(list(argv)))


def test_sglang_and_vllm_names_of_one_option_set_one_field() -> None:
    assert _cli("--max-num-seqs", "8").max_running_requests == 8
    assert _cli("--max-running-requests", "8").max_running_requests == 8
    assert _cli().max_running_requests is None
    for argv in (["--disable-overlap-schedule"], ["--disable-overlap-schedule", "--overlap-schedule", "on"],
                 ["--overlap-schedule", "on", "--disable-overlap-schedule"]):
        assert _cli(*argv).overlap_schedule == "off", argv  # SGLang's switch wins, wherever it stands
    assert _cli("--overlap-schedule", "on").overlap_schedule == "on"
    assert not hasattr(ServerArgs(), "max_num_seqs") and not hasattr(ServerArgs(), "disable_overlap_schedule")

    assert ServerArgs.from_kwargs(max_num_seqs=3).max_running_requests == 3
    assert ServerArgs.from_kwargs(disable_overlap_schedule=True, overlap_schedule="on").overlap_schedule == "off"
    assert ServerArgs.from_kwargs(disable_overlap_schedule=False).overlap_schedule == "auto"
    assert ServerArgs().replace(max_num_seqs=5).max_running_requests == 5
    assert ServerArgs.from_kwargs(max_num_seqs=4, max_running_requests=4).max_running_requests == 4
    with pytest.raises(ValueError, match="max_num_seqs and max_running_requests are the same option"):
        ServerArgs.from_kwargs(max_num_seqs=4, max_running_requests=8)
    with pytest.raises(ValueError, match="max_running_requests must be a positive integer"):
        _cli("--max-num-seqs", "0")


def test_help_names_both_spellings() -> None:
    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    text = " ".join(p.format_help().split())
    assert "--max-running-requests MAX_RUNNING_REQUESTS, --max-num-seqs MAX_RUNNING_REQUESTS" in text
    assert "--disable-overlap-schedule Same as --overlap-schedule off." in text


@pytest.mark.parametrize("cls, home", [(ServerArgs, "radixserve/config/"), (RouterArgs, "radixserve/router/config.py")])
def test_every_option_is_read_outside_its_declaration(cls: type, home: str) -> None:
    """No accepted-and-ignored option: each field is read somewhere other than where it is
    declared and checked (as an attribute, or by name)."""
    root = Path(__file__).resolve().parents[1]
    sources = [p.read_text() for p in (root / "radixserve").rglob("*.py")
               if not str(p.relative_to(root)).startswith(home)]
    for f in dataclasses.fields(cls):
        used = re.compile(rf"\.{f.name}\b|[\"']{f.name}[\"']")
        assert any(used.search(s) for s in sources), f"{cls.__name__}.{f.name} is never read"


def test_the_transfer_backends_offered_are_the_ones_there_are() -> None:
    from radixserve.disagg.transfer import TRANSFER_BACKENDS
    choices = {f.name: f for f in dataclasses.fields(ServerArgs)}["disaggregation_transfer_backend"].metadata["choices"]
    assert set(choices) == set(TRANSFER_BACKENDS)


def test_speculative_options_are_checked() -> None:
    assert ServerArgs(speculative_algorithm="NGRAM").speculative_algorithm == "NGRAM"
    with pytest.raises(ValueError, match="speculative_algorithm must be one of ngram"):
        ServerArgs(speculative_algorithm="eagle")
    with pytest.raises(ValueError, match="at least speculative_ngram_min_match_window_size"):
        ServerArgs(speculative_ngram_min_match_window_size=4, speculative_ngram_max_match_window_size=2)
    with pytest.raises(ValueError, match="speculative_num_draft_tokens must be a positive"):
        ServerArgs(speculative_num_draft_tokens=0)
