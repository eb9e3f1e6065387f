"""``shared_server``: one real server, started once per session and shared by every test that can
share it. Its teardown is itself a check: Ctrl-C (SIGINT to the whole process group, as a terminal
sends it) must stop the HTTP, scheduler and detokenizer processes and exit 0.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from tests.server.helpers import ServerProcess, pid_alive


@pytest.fixture(scope="session")
def shared_server() -> Iterator[ServerProcess]:
    srv = ServerProcess("--enable-metrics")
    try:
        srv.wait_ready()
        yield srv
        if srv.proc.poll() is None:
            code = srv.interrupt()
            assert code == 0, f"Ctrl-C exit code {code}:\n{srv.log_text()[-3000:]}"
            time.sleep(0.5)
            left = [p for p in srv.children() if pid_alive(p)]
            assert not left, f"orphan processes after Ctrl-C: {left}"
    finally:
        srv.kill()
        os.unlink(srv.log.name)
