"""Building and loading the C++ extensions: a build killed half-way must not stop every later load."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from radixserve.model.cpp_build import build_dir, cpu_tag
from radixserve.model.fused_ops import extension_error


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_load(tmp_path: Path) -> None:
    """torch's build lock is a plain file that a killed build leaves behind; ``load`` then waited
    for it forever (a server stopped while it built on first use never started again)."""
    if extension_error() is not None:
        pytest.skip(f"the fused ops extension is unavailable here: {extension_error()}")
    name = f"radixserve_fused_ops_{cpu_tag()}"
    shutil.copytree(build_dir() / name, tmp_path / name)  # the built extension, as it is
    (tmp_path / name / "lock").write_text("")  # what a build killed half-way leaves
    code = "from radixserve.model.fused_ops import extension_error; print(extension_error())"
    env = {**os.environ, "RADIXSERVE_BUILD_DIR": str(tmp_path)}
    try:
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.fail("the load waited on the stale lock")
    assert out.returncode == 0 and out.stdout.strip() == "None", out.stdout + out.stderr
    assert not (tmp_path / name / "lock").exists()


def test_loading_an_extension_again_keeps_its_build() -> None:
    """torch appends its libraries to the link flags it is given; were those the module's own list,
    every later load in the process would hash differently, and a second load of one extension
    (two test files checking one variant) would rename and recompile it, in every process."""
    from torch.utils.cpp_extension import JIT_EXTENSION_VERSIONER

    from radixserve.model import cpp_build, fused_ops

    if extension_error() is not None:
        pytest.skip(f"the fused ops extension is unavailable here: {extension_error()}")
    flags = list(cpp_build.LDFLAGS)
    for _ in range(2):
        ext, err = cpp_build.load_extension("radixserve_fused_ops", fused_ops._SOURCE, fused_ops._CFLAGS)
        assert ext is not None, err
    assert cpp_build.LDFLAGS == flags
    assert JIT_EXTENSION_VERSIONER.entries[f"radixserve_fused_ops_{cpu_tag()}"].version == 0
