"""``/dashboard`` in a real headless Chromium, on the shared server under a small workload.

Needs Debian's ``chromium`` and the ``playwright`` package (scripts/setup.sh installs both); it
skips, saying which is missing, without them. Playwright's own browser download is not used: it
drives the system's chromium through ``executable_path``. The screenshot is saved to
``test-artifacts/dashboard.png`` (git-ignored).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from tests.server.helpers import REPO, ServerProcess, fake_dashboard_tm, free_port, wait_idle

pytestmark = pytest.mark.slow  # real servers: the full tier only (scripts/test.sh --fast leaves it out)

ARTIFACT = os.path.join(REPO, "test-artifacts", "dashboard.png")
WORKLOAD = 4  # concurrent requests, long enough to still run when the page is read, then aborted
# NOTE: not longer: admission reserves part of max_new_tokens (new_token_ratio), and all four must
# run at once in the shared server's 8,192-token pool, none waiting
LONG = {"max_new_tokens": 1500, "ignore_eos": True, "temperature": 0}


def _browser_or_skip() -> tuple[Any, str]:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip("no chromium on PATH (Debian: apt-get install -y chromium; scripts/setup.sh does it as root)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("the playwright package is not installed (pip install -e '.[dev]')")
    return sync_playwright, exe


@pytest.fixture
def workload(shared_server: ServerProcess) -> Iterator[list[str]]:
    """``WORKLOAD`` requests running on the shared server; aborted and drained afterwards."""
    rids = [f"dashboard-{i}-{time.monotonic_ns()}" for i in range(WORKLOAD)]

    def send(i: int) -> None:
        body = {"text": f"Tell a long story about the number {i}.", "rid": rids[i], "priority": i % 2,
                "sampling_params": LONG}
        with shared_server.client() as c:
            c.post("/generate", json=body)  # returns when aborted

    threads = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(WORKLOAD)]
    for t in threads:
        t.start()
    with shared_server.client() as c:
        try:
            deadline = time.monotonic() + 30
            while _running(load := c.get("/get_load").json()[0]) < WORKLOAD or load["num_waiting_reqs"]:
                assert time.monotonic() < deadline, f"the workload did not start: {load}"
                time.sleep(0.05)
            yield rids
        finally:
            for rid in rids:
                c.post("/abort_request", json={"rid": rid})
            for t in threads:
                t.join(30)
            wait_idle(c)


def _running(load: dict[str, Any]) -> int:
    return int(load["num_reqs"] - load["num_waiting_reqs"])


def _open_dashboard(browser: Any, url: str, errors: list[str], height: int) -> Any:
    """A page on ``url`` whose console errors and uncaught exceptions go to ``errors``, after its
    first poll of the state endpoint."""
    page = browser.new_page(viewport={"width": 1400, "height": height})
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url)
    page.wait_for_function("Number(document.body.dataset.polls || 0) >= 1", timeout=10_000)
    return page


@contextmanager
def dashboard_page(url: str, height: int) -> Iterator[tuple[Any, list[str]]]:
    """A headless Chromium page on the dashboard at ``url`` after its first poll, and the list its
    console errors go to (skips without chromium or playwright)."""
    sync_playwright, exe = _browser_or_skip()
    errors: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=exe, headless=True)
        try:
            yield _open_dashboard(browser, url, errors, height), errors
        finally:
            browser.close()


def _polls(page: Any) -> int:
    return int(page.evaluate("Number(document.body.dataset.polls || 0)"))


def test_dashboard_in_chromium(shared_server: ServerProcess, workload: list[str]) -> None:
    sync_playwright, exe = _browser_or_skip()
    errors: list[str] = []
    with sync_playwright() as pw, shared_server.client() as c:
        browser = pw.chromium.launch(executable_path=exe, headless=True)
        try:
            page = _open_dashboard(browser, f"{shared_server.url}/dashboard", errors, height=1000)

            # What the page shows comes from one poll; bracket that poll between two /get_load calls.
            # While every request decodes (none finishes, none waits) the KV in use only grows.
            before = c.get("/get_load").json()[0]
            n = _polls(page)
            page.wait_for_function(f"Number(document.body.dataset.polls) > {n}", timeout=10_000)
            shown = {k: page.inner_text(f'[data-k="{k}"]') for k in ("running", "waiting", "kv-used", "kv-usage",
                                                                    "kv-total", "policy")}
            after = c.get("/get_load").json()[0]
            info = c.get("/get_server_info").json()
            assert _running(before) == _running(after) == WORKLOAD
            assert int(shown["running"]) == WORKLOAD and int(shown["waiting"]) == 0
            used = int(shown["kv-used"].replace(",", ""))
            total = int(shown["kv-total"].replace(",", ""))
            assert total == info["max_total_num_tokens"]
            assert before["num_tokens"] <= used <= after["num_tokens"], (before, shown, after)
            usage = float(shown["kv-usage"].rstrip("%")) / 100
            assert before["num_tokens"] / total - 0.001 <= usage <= after["num_tokens"] / total + 0.001
            assert shown["policy"] == info["schedule_policy"]
            assert int(page.inner_text('[data-k="steps-rate"]').split(".")[0]) >= 0  # a rate once two polls are in

            os.makedirs(os.path.dirname(ARTIFACT), exist_ok=True)
            page.screenshot(path=ARTIFACT, full_page=True)
            print(f"dashboard screenshot: {ARTIFACT}")

            # the policy switch: pick another policy, click, and the server runs it
            old = info["schedule_policy"]
            new = "lpm" if old != "lpm" else "fcfs"
            try:
                page.select_option("#policy-select", new)
                page.click("#policy-apply")
                page.wait_for_function(f"document.getElementById('policy-status').textContent === 'now {new}'",
                                       timeout=10_000)
                assert c.get("/get_server_info").json()["schedule_policy"] == new
                page.wait_for_function(f"document.querySelector('[data-k=policy]').textContent === '{new}'",
                                       timeout=10_000)
            finally:
                r = c.post("/set_schedule_policy", json={"schedule_policy": old})
                assert r.status_code == 200 and c.get("/get_server_info").json()["schedule_policy"] == old
        finally:
            browser.close()
    assert not errors, f"console errors on /dashboard: {errors}"


def _serve_fake(api_key: str | None) -> Iterator[str]:
    """The real app over a fake scheduler (``fake_dashboard_tm``), served by uvicorn in a thread."""
    import uvicorn

    from radixserve.server.frontend.http_server import create_app

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(fake_dashboard_tm(api_key), "fake-model", {}),
                                           host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture
def keyed_app() -> Iterator[str]:
    yield from _serve_fake("sk-dash")


@pytest.fixture
def router_over_fakes() -> Iterator[str]:
    """A router (its own event loop, in a thread) in front of a fake server and a worker that is down."""
    import asyncio

    from tests.router.router_helpers import Fleet

    fake = _serve_fake(None)
    worker = next(fake)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    fleet = Fleet()
    dead = f"http://127.0.0.1:{free_port()}"
    try:
        asyncio.run_coroutine_threadsafe(fleet.start_router([worker, dead]), loop).result(30)
        yield fleet.url
    finally:
        asyncio.run_coroutine_threadsafe(fleet.close(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        fake.close()


def test_dashboard_sends_the_key_from_its_url(keyed_app: str) -> None:
    """With --api-key: the page loads without the key, asks for it on a 401, and uses the key given
    in its URL fragment (which never reaches the server's logs)."""
    sync_playwright, exe = _browser_or_skip()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=exe, headless=True)
        try:
            page = browser.new_page()
            page.goto(f"{keyed_app}/dashboard")
            page.wait_for_function("document.getElementById('status').textContent === 'API key needed'",
                                   timeout=10_000)
            assert page.is_visible("#auth")
            page.fill("#auth-key", "sk-dash")
            page.click("#auth button")
            page.wait_for_function("Number(document.body.dataset.polls || 0) >= 1", timeout=10_000)
            assert page.is_hidden("#auth") and page.inner_text('[data-k="running"]') == "0"

            fresh = browser.new_page()  # a new page has no stored key: the fragment gives it
            fresh.goto(f"{keyed_app}/dashboard#api_key=sk-dash")
            fresh.wait_for_function("Number(document.body.dataset.polls || 0) >= 1", timeout=10_000)
            assert fresh.is_hidden("#auth")
            assert httpx.get(f"{keyed_app}/dashboard/state").status_code == 401
        finally:
            browser.close()


def test_router_dashboard_in_chromium(router_over_fakes: str) -> None:
    """The router's page: its queue, then a column per worker; a worker that is down shows an error."""
    with dashboard_page(f"{router_over_fakes}/dashboard", height=900) as (page, errors):
        assert page.inner_text('[data-k="router-waiting"]') == "0"
        columns = page.locator(".column")
        assert columns.count() == 2
        assert columns.nth(0).locator('[data-k="running"]').inner_text() == "0"
        assert "unreachable" in columns.nth(1).inner_text().lower()
        page.screenshot(path=os.path.join(os.path.dirname(ARTIFACT), "dashboard-router.png"), full_page=True)
    assert not errors, f"console errors on the router's /dashboard: {errors}"
