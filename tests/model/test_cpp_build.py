"""Building and loading the C++ extensions: a build killed half-way must not stop every later load."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from radixserve.model.cpp_build import STAMP, build_dir, build_key, cpu_tag
from radixserve.model.fused_ops import extension_error


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_load(tmp_path: Path) -> None:
    """torch's build lock is a plain file that a killed build leaves behind; ``load`` then waited
    for it forever (a server stopped while it built on first use never started again)."""
    if extension_error() is not None:
        pytest.skip(f"the fused ops extension is unavailable here: {extension_error()}")
    name = f"radixserve_fused_ops_{cpu_tag()}"
    shutil.copytree(build_dir() / name, tmp_path / name)  # the built extension, as it is
    (tmp_path / name / STAMP).unlink(missing_ok=True)  # so torch's load (and its lock) is asked
    (tmp_path / name / "lock").write_text("")  # what a build killed half-way leaves
    code = "from radixserve.model.fused_ops import extension_error; print(extension_error())"
    env = {**os.environ, "RADIXSERVE_BUILD_DIR": str(tmp_path)}
    try:
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.fail("the load waited on the stale lock")
    assert out.returncode == 0 and out.stdout.strip() == "None", out.stdout + out.stderr
    assert not (tmp_path / name / "lock").exists()


def test_loading_an_extension_again_keeps_its_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch appends its libraries to the link flags it is given; were those the module's own list,
    every later load in the process would hash differently, and a second load of one extension
    (two test files checking one variant) would rename and recompile it, in every process."""
    from torch.utils.cpp_extension import JIT_EXTENSION_VERSIONER

    from radixserve.model import cpp_build, fused_ops

    if extension_error() is not None:
        pytest.skip(f"the fused ops extension is unavailable here: {extension_error()}")
    name = f"radixserve_fused_ops_{cpu_tag()}"
    shutil.copytree(build_dir() / name, tmp_path / name)
    (tmp_path / name / STAMP).unlink(missing_ok=True)  # so the first load below is torch's
    monkeypatch.setenv("RADIXSERVE_BUILD_DIR", str(tmp_path))
    flags = list(cpp_build.LDFLAGS)
    for _ in range(2):
        ext, err = cpp_build.load_extension("radixserve_fused_ops", fused_ops._SOURCE, fused_ops._CFLAGS)
        assert ext is not None, err
    assert cpp_build.LDFLAGS == flags
    assert JIT_EXTENSION_VERSIONER.entries[name].version == 0


def test_a_stamped_build_loads_without_asking_torch(tmp_path: Path) -> None:
    """A load through torch stamps the build; the next process imports it as it is, without torch's
    ``load`` (which runs ninja to learn that nothing changed)."""
    if extension_error() is not None:
        pytest.skip(f"the fused ops extension is unavailable here: {extension_error()}")
    name = f"radixserve_fused_ops_{cpu_tag()}"
    shutil.copytree(build_dir() / name, tmp_path / name)
    (tmp_path / name / STAMP).unlink(missing_ok=True)
    env = {**os.environ, "RADIXSERVE_BUILD_DIR": str(tmp_path)}
    load = ("from radixserve.model import cpp_build, fused_ops\n"
            "ext, err = cpp_build.load_extension('radixserve_fused_ops', fused_ops._SOURCE, fused_ops._CFLAGS)\n"
            "print(err if ext is None else ext.__file__)\n")
    refuse = ("import torch.utils.cpp_extension as c\n"
              "def refuse(*a, **k): raise AssertionError('torch was asked')\n"
              "c.load = refuse\n")
    first = subprocess.run([sys.executable, "-c", load], env=env, capture_output=True, text=True, timeout=300)
    assert first.stdout.strip().startswith(str(tmp_path / name)), first.stdout + first.stderr
    assert (tmp_path / name / STAMP).is_file()
    second = subprocess.run([sys.executable, "-c", refuse + load], env=env, capture_output=True, text=True, timeout=300)
    assert second.stdout.strip() == first.stdout.strip(), second.stdout + second.stderr
    (tmp_path / name / STAMP).write_text('{"key": "stale", "module": "x", "file": "x.so"}')
    third = subprocess.run([sys.executable, "-c", refuse + load], env=env, capture_output=True, text=True, timeout=300)
    assert "torch was asked" in third.stdout, third.stdout + third.stderr  # a stale stamp is not trusted


def test_a_stamp_names_what_the_build_was_made_from(tmp_path: Path) -> None:
    """The stamp's key changes with the source, a header beside it, and the flags; a stamp whose
    key does not match is not used."""
    from radixserve.model import cpp_build

    (tmp_path / "k.cpp").write_text("int f() { return 1; }\n")
    (tmp_path / "k.h").write_text("#define A 1\n")
    key = build_key("k", tmp_path / "k.cpp", ["-O3"])
    assert build_key("k", tmp_path / "k.cpp", ["-O3"]) == key
    assert build_key("k", tmp_path / "k.cpp", ["-O2"]) != key
    (tmp_path / "k.h").write_text("#define A 2\n")
    assert build_key("k", tmp_path / "k.cpp", ["-O3"]) != key
    (tmp_path / STAMP).write_text(json.dumps({"key": key, "module": "k", "file": "k.so"}))
    assert cpp_build._stamped(tmp_path, build_key("k", tmp_path / "k.cpp", ["-O3"])) is None  # stale
    assert cpp_build._stamped(tmp_path, key) is None  # matching, but no library there
