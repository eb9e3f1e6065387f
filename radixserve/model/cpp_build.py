"""Build a C++ extension of this package on first use (``torch.utils.cpp_extension.load``).

Sources live in ``csrc/``; builds go to ``.build/`` at the repository root (``RADIXSERVE_BUILD_DIR``
overrides), one directory per extension and CPU (``-march=native`` code built on one CPU may not
run on another). ``scripts/setup.sh`` builds them ahead; a failed build is reported, not raised,
so the pure-torch paths keep working without a compiler.

torch's ``load`` runs ninja to learn that a build is current (~0.13 s an extension, four of them on
every scheduler's start-up path). After a build, a stamp beside it records what it was built from
(the source, the headers beside it, the flags, torch and Python); a load whose stamp matches imports
the built library directly. A rebuild removes the stamp first, so a matching stamp always names a
finished library.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CFLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp"]
# NOTE: at::parallel_for is a header template that runs serially unless the extension itself is
# compiled with OpenMP; linking libgomp by its soname makes the loader reuse the one torch loaded.
LDFLAGS = ["-fopenmp"]


def cpu_tag() -> str:
    """A short hash of the CPU's feature flags, so builds for different CPUs (a shared home, a
    copied tree) never mix."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    return hashlib.sha1(flags.encode()).hexdigest()[:8]


def build_dir() -> Path:
    env = os.environ.get("RADIXSERVE_BUILD_DIR")
    if env:
        return Path(env)
    root = Path(__file__).resolve().parents[2]
    if (root / "pyproject.toml").exists():  # a source checkout (editable install)
        return root / ".build"
    return Path.home() / ".cache" / "radixserve" / "build"


@contextlib.contextmanager
def _build_lock(directory: Path) -> Iterator[None]:
    """One process at a time builds or loads an extension directory, under an ``flock`` that the
    kernel releases when its holder dies. torch's own lock is a file created with O_EXCL and
    removed when its build ends: a process killed mid-build (a server stopped while it built on
    first use) leaves it behind, and every later ``load`` then waits for it forever. Under our
    lock no other build of ours is running, so a torch lock file found there is such a leftover."""
    with open(directory / ".radixserve-lock", "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        try:
            (directory / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)


STAMP = "radixserve-build.json"


def build_key(name: str, source: Path, cflags: list[str]) -> str:
    """What a build depends on: the source, every header beside it (the sources include them by
    name), the flags, and the torch and Python it links against."""
    import torch

    h = hashlib.sha1()
    for part in (name, *cflags, *LDFLAGS, torch.__version__, sys.version):
        h.update(part.encode() + b"\0")
    for path in (source, *sorted(source.parent.glob("*.h"))):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def _stamped(directory: Path, key: str) -> Any | None:
    """The built module if the stamp in ``directory`` matches ``key``, else None."""
    try:
        stamp = json.loads((directory / STAMP).read_text())
        if stamp.get("key") != key:
            return None
        spec = importlib.util.spec_from_file_location(stamp["module"], directory / stamp["file"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if spec is None or spec.loader is None or not (directory / stamp["file"]).is_file():
        return None
    loaded = sys.modules.get(spec.name)
    if loaded is not None and getattr(loaded, "__file__", None) == spec.origin:
        return loaded
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[spec.name] = module
    return module


def _write_stamp(directory: Path, key: str, module: Any) -> None:
    path = Path(module.__file__)
    if path.parent.resolve() != directory.resolve():
        return
    tmp = directory / (STAMP + ".tmp")
    tmp.write_text(json.dumps({"key": key, "module": module.__name__, "file": path.name}))
    tmp.replace(directory / STAMP)


def load_extension(stem: str, source: Path, extra_cflags: list[str] | None = None) -> tuple[Any, str | None]:
    """(the module, None), or (None, why it could not be built). Callers cache the result."""
    try:
        name = f"{stem}_{cpu_tag()}"
        directory = build_dir() / name
        cflags = [*CFLAGS, *(extra_cflags or [])]
        key = build_key(name, source, cflags)
        module = _stamped(directory, key)
        if module is not None:
            return module, None
        import sysconfig

        from torch.utils.cpp_extension import load

        # the ninja that pip installed sits next to this interpreter's scripts, which need not be on
        # PATH (a venv run without activating it); torch looks it up on PATH, even for a cached build
        scripts = sysconfig.get_path("scripts")
        if scripts and scripts not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
        directory.mkdir(parents=True, exist_ok=True)
        with _build_lock(directory):
            (directory / STAMP).unlink(missing_ok=True)
            # NOTE: fresh lists: torch appends its libraries to extra_ldflags in place, and a flag list
            # that grew changes the next load's hash, so a second load of one extension in a process
            # would be renamed (name_v1) and recompiled, and the next process would recompile it back
            ext = load(name=name, sources=[str(source)], extra_cflags=cflags,
                       extra_ldflags=list(LDFLAGS), build_directory=str(directory), verbose=False)
            _write_stamp(directory, key, ext)
        return ext, None
    except Exception as e:  # any build failure means "unavailable", with its reason
        return None, f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
