"""``ServerArgs`` refuses a bad combination of options at construction, naming every problem at
once (one group of checks per area), and never with anything but a ``ValueError``."""

from __future__ import annotations

import re
from typing import Any

import pytest

from radixserve.config import ServerArgs


@pytest.mark.parametrize("kw, says", [
    ({"page_size": 0}, "page_size must be a positive integer"),
    ({"page_size": 0, "chunked_prefill_size": 64}, "page_size must be a positive integer"),  # no division by 0
    ({"chunked_prefill_size": 7, "page_size": 4}, "chunked_prefill_size must be a multiple of page_size"),
    ({"chat_template": "no-such-file"}, "neither a file nor a Jinja template"),
    ({"disaggregation_mode": "prefill", "disable_radix_cache": True}, "cannot be used with --disable-radix-cache"),
    ({"port": 70000}, "port must be in [0, 65535]"),
    ({"dp_size": 0}, "dp_size must be a positive integer"),
    ({"max_num_seqs": 0}, "max_num_seqs must be a positive integer"),
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
        ServerArgs(page_size=0, port=-1, queue_timeout=0.0, max_num_seqs=-3)
    msg = str(e.value)
    for part in ("page_size", "port must be", "queue_timeout", "max_num_seqs"):
        assert part in msg


def test_defaults_are_valid() -> None:
    assert ServerArgs().page_size == 1
