"""``shared_server``: one real server, started once per session and shared by every test that can
share it. Its teardown is itself a check: Ctrl-C (SIGINT to the whole process group, as a terminal
sends it) must stop the HTTP, scheduler and detokenizer processes and exit 0.

``keyed_server``: a second one with ``--api-key`` and a 4 KiB body limit, for the tests of keys,
body limits and child deaths; started on first use and again after a test ended it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from tests.server.helpers import API_KEY, ServerProcess, free_port, pid_alive


@pytest.fixture(scope="session")
def shared_server() -> Iterator[ServerProcess]:
    kv_port = free_port()  # it publishes its cache in vLLM's KV-event schema too (test_kv_events.py)
    srv = ServerProcess("--enable-metrics", "--kv-events-config",
                        f'{{"endpoint": "tcp://127.0.0.1:{kv_port}", "bind": true, "topic": "kv"}}')
    srv.kv_events_port = kv_port  # type: ignore[attr-defined]
    try:
        srv.wait_ready()
        yield srv
        if srv.proc.poll() is None:  # a graceful stop with a request in flight (SIGTERM), then its children
            code = srv.drain()
            assert code == 0, f"exit code {code} after draining:\n{srv.log_text()[-3000:]}"
            time.sleep(0.5)
            left = [p for p in srv.children() if pid_alive(p)]
            assert not left, f"orphan processes after Ctrl-C: {left}"
    finally:
        srv.kill()
        os.unlink(srv.log.name)


@pytest.fixture(scope="session")
def _keyed() -> Iterator[dict[str, ServerProcess]]:
    held: dict[str, ServerProcess] = {}
    try:
        yield held
    finally:
        if "srv" in held:
            held["srv"].kill()
            os.unlink(held["srv"].log.name)


@pytest.fixture
def keyed_server(_keyed: dict[str, ServerProcess]) -> ServerProcess:
    srv = _keyed.get("srv")
    if srv is None or srv.proc.poll() is not None:  # not started yet, or a test ended it
        if srv is not None:
            srv.kill()
            os.unlink(srv.log.name)
        srv = _keyed["srv"] = ServerProcess("--max-request-body-bytes", "4096", "--tool-call-parser", "hermes",
                                            api_key=API_KEY)
        srv.wait_ready()
    return srv
