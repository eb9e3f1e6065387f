"""The scheduler zygote: children forked on request report their pid and exit code, take signals,
write to the requester's output, watch the requester; the zygote goes when its parent does."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from radixserve.server.procs import run_entry
from radixserve.server.zygote import ZygoteChild, _connect

REPO = Path(__file__).resolve().parents[2]


def watch_and_report(path: str) -> None:
    """In a forked child: what ``parent_alive`` says about the requester (this test's process)."""
    from radixserve.server import procs

    Path(path).write_text(str(procs.parent_alive(-1)))


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    path = str(tmp_path_factory.mktemp("zygote") / "sock")
    proc = subprocess.Popen([sys.executable, "-m", "radixserve.server.zygote", path, str(os.getpid())], cwd=REPO)
    yield path
    proc.terminate()
    proc.wait(10)


def entry(name: str) -> functools.partial[None]:
    return functools.partial(run_entry, name)


def test_a_child_reports_its_exit_code(zygote: str) -> None:
    child = ZygoteChild(zygote, "exits", entry("os:_exit"), (3,))
    assert child.pid > 0 and child.pid != os.getpid()
    child.join(60)
    assert child.exitcode == 3 and not child.is_alive()


def test_a_child_takes_signals(zygote: str) -> None:
    child = ZygoteChild(zygote, "sleeps", entry("time:sleep"), (60,))
    assert child.is_alive()
    child.terminate()
    child.join(30)
    assert child.exitcode == -15


def test_a_child_writes_to_the_requesters_output(zygote: str, capfd: pytest.CaptureFixture[str]) -> None:
    child = ZygoteChild(zygote, "prints", entry("builtins:print"), ("written by the forked child",))
    child.join(60)
    assert child.exitcode == 0
    assert "written by the forked child" in capfd.readouterr().out


def test_a_child_watches_its_requester_not_its_parent(zygote: str, tmp_path: Path) -> None:
    """Its parent is the zygote; ``parent_alive`` must follow the process that asked for it."""
    out = tmp_path / "alive"
    child = ZygoteChild(zygote, "watches", entry("tests.server.test_zygote:watch_and_report"), (str(out),))
    child.join(60)
    assert child.exitcode == 0, out.read_text() if out.exists() else "no report"
    assert out.read_text() == "True"


def test_a_malformed_request_does_not_stop_the_zygote(zygote: str) -> None:
    with _connect(zygote) as bad:  # (waits for the zygote to bind, as a worker does)
        bad.sendall(b"not a request")  # no length, no descriptors
        try:
            answer = bad.recv(16)
        except ConnectionResetError:  # closed with the bytes it did not read
            answer = b""
        assert answer == b""  # the zygote hung up on it, without forking anything
    child = ZygoteChild(zygote, "after", entry("os:_exit"), (0,))
    child.join(60)
    assert child.exitcode == 0


def test_the_zygote_leaves_when_its_parent_is_gone(tmp_path: Path) -> None:
    """Started for a parent that is not (or no longer) its parent, it exits at its next look."""
    proc = subprocess.Popen([sys.executable, "-m", "radixserve.server.zygote", str(tmp_path / "sock"), "1"], cwd=REPO)
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert proc.poll() == 0
