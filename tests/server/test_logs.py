"""What the server writes to its terminal (stderr, captured by ``ServerProcess``): the load
progress bar at start-up and SGLang's periodic decode-batch line."""

from __future__ import annotations

import re
import time

import pytest

from radixserve.server.launch import LOAD_STAGES
from tests.server.helpers import ServerProcess

pytestmark = pytest.mark.slow  # real servers: the full tier only (scripts/test.sh --fast leaves it out)

DECODE_LINE = re.compile(
    r"Decode batch\. #running-req: (\d+), #token: (\d+), token usage: (\d+\.\d+), "
    r"gen throughput \(token/s\): (\d+\.\d+), #queue-req: (\d+)"
)
DECODE_LOG_INTERVAL = 20  # ServerProcess starts every server with --decode-log-interval 20


def test_load_progress_bar(shared_server: ServerProcess) -> None:
    log = shared_server.log_text()
    ready = log.index("serving ")  # the "serving <model> on http://..." line once everything is up
    bar = log[:ready]
    assert re.search(r"Loading \S+: +0%\|", bar), bar[-2000:]
    assert re.search(rf"Loading \S+: 100%\|[^|]*\| {LOAD_STAGES}/{LOAD_STAGES} ", bar), bar[-2000:]
    for stage in ("tokenizer loaded", "detokenizer ready", "scheduler ready"):
        assert stage in bar, stage


def test_decode_log_line(shared_server: ServerProcess) -> None:
    start = len(shared_server.log_text())
    with shared_server.client() as c:
        r = c.post("/generate", json={"text": "Tell me a story.",
                                      "sampling_params": {"max_new_tokens": 2 * DECODE_LOG_INTERVAL + 1,
                                                          "ignore_eos": True}})
        assert r.status_code == 200
    deadline = time.monotonic() + 10  # the scheduler process writes it; give the write a moment
    while not (lines := DECODE_LINE.findall(shared_server.log_text()[start:])) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert lines, shared_server.log_text()[start:][-2000:]
    # 40 decode steps hold two logged steps (every 20th of the server's count), at most one of them
    # the request's last: at least one line shows it running; none shows requests without KV
    assert any(int(running) >= 1 and int(tokens) > 0 for running, tokens, *_ in lines), lines
    for running, tokens, usage, throughput, queued in lines:
        assert int(running) == 0 or int(tokens) > 0, lines
        assert int(queued) >= 0 and 0.0 <= float(usage) <= 1.0 and float(throughput) > 0.0
