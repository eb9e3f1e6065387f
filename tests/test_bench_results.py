"""Benchmark results carry when, what and where they were measured."""

from __future__ import annotations

import json
from pathlib import Path

from radixserve.results import machine, machine_tag, write_result


def test_a_result_file_says_when_what_and_where(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    write_result(str(path), {"output_throughput": 12.5, "results": [{"engine": "radixserve"}]})
    doc = json.loads(path.read_text())
    assert doc["output_throughput"] == 12.5 and doc["results"] == [{"engine": "radixserve"}]
    assert doc["date"][:2] == "20" and "T" in doc["date"]
    assert doc["machine"] == machine()
    assert doc["machine"]["cores"] >= 1 and doc["machine"]["cpu"]
    assert isinstance(doc["command"], list) and doc["command"]


def test_cpu_features_are_the_ones_proc_cpuinfo_lists() -> None:
    flags: set[str] = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    feats = machine()["cpu_features"]
    assert set(feats) <= flags
    assert ("avx512f" in feats) == ("avx512f" in flags) and ("avx2" in feats) == ("avx2" in flags)


def test_the_machine_tag_names_a_folder() -> None:
    tag = machine_tag()
    assert tag.endswith(f"-{machine()['cores']}c") and "/" not in tag and " " not in tag
