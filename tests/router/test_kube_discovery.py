"""``--discovery-provider kubernetes`` against a fake Kubernetes API server: the real ``kubernetes``
client lists and watches pods over HTTP (credentials from a kubeconfig, as outside a cluster), and a
router follows them live: ready pods join, pending, unready, terminating, deleted and unselected
ones stay out, an API outage changes nothing, PD roles and ports come from labels and annotations."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from kubernetes import client as k8s

from radixserve.bench.stub_worker import create_stub_app
from radixserve.router.app import run_router
from radixserve.router.config import RouterArgs
from radixserve.router.discovery import WorkerEntry
from radixserve.router.kube_discovery import pod_worker
from tests.router.router_helpers import Fleet, free_port, post, run

NAMESPACE = "serving"
SELECTOR = "app=radixserve-worker"


def pod(name: str, port: int, ready: bool = True, phase: str = "Running", labels: dict[str, str] | None = None,
        annotations: dict[str, str] | None = None, ip: str = "127.0.0.1", terminating: bool = False,
        namespace: str = NAMESPACE) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace,
                            "labels": {"app": "radixserve-worker", **(labels or {})},
                            "annotations": {"radixserve.io/port": str(port), **(annotations or {})}}
    if terminating:
        meta["deletionTimestamp"] = "2026-11-27T00:00:00Z"
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "status": {"phase": phase, "podIP": ip if phase == "Running" else None,
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def _selects(selector: str, labels: dict[str, str]) -> bool:
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        assert _ == "=", f"the fake API server knows equality selectors only, not {term!r}"
        if labels.get(key) != value:
            return False
    return True


class FakeKubeAPI:
    """The pods endpoint of a Kubernetes API server: list (with resourceVersion) and watch (JSON lines,
    ended after timeoutSeconds), filtered by namespace and label selector as the real one does."""

    def __init__(self) -> None:
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.version = 1
        self.watchers: list[tuple[str, str, asyncio.Queue[dict[str, Any] | None]]] = []
        self.failing = False
        self.lists = 0

    def _tell(self, kind: str, p: dict[str, Any]) -> None:
        for ns, selector, queue in self.watchers:
            if p["metadata"]["namespace"] == ns and _selects(selector, p["metadata"]["labels"]):
                queue.put_nowait({"type": kind, "object": p})

    def put(self, p: dict[str, Any]) -> None:
        key = (p["metadata"]["namespace"], p["metadata"]["name"])
        self.version += 1
        p["metadata"]["resourceVersion"] = str(self.version)
        kind = "MODIFIED" if key in self.pods else "ADDED"
        self.pods[key] = p
        self._tell(kind, p)

    def delete(self, name: str) -> None:
        self.version += 1
        self._tell("DELETED", self.pods.pop((NAMESPACE, name)))

    def fail(self, failing: bool) -> None:
        self.failing = failing
        for *_, queue in self.watchers:
            queue.put_nowait(None)  # ends every watch: the client lists again, and meets the outage

    async def pods_endpoint(self, request: web.Request) -> web.StreamResponse:
        ns, selector = request.match_info["ns"], request.query.get("labelSelector", "")
        if self.failing:
            return web.json_response({"kind": "Status", "status": "Failure", "code": 500, "message": "etcd down"},
                                     status=500)
        if request.query.get("watch") not in ("true", "True", "1"):
            self.lists += 1
            items = [p for (pns, _), p in sorted(self.pods.items())
                     if pns == ns and _selects(selector, p["metadata"]["labels"])]
            return web.json_response({"kind": "PodList", "apiVersion": "v1",
                                      "metadata": {"resourceVersion": str(self.version)}, "items": items})
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        entry = (ns, selector, queue)
        self.watchers.append(entry)
        deadline = asyncio.get_running_loop().time() + float(request.query.get("timeoutSeconds", 60))
        try:
            while (left := deadline - asyncio.get_running_loop().time()) > 0:
                try:
                    ev = await asyncio.wait_for(queue.get(), left)
                except asyncio.TimeoutError:
                    break
                if ev is None:
                    break
                await resp.write(json.dumps(ev).encode() + b"\n")
        finally:
            self.watchers.remove(entry)
        return resp

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{ns}/pods", self.pods_endpoint)
        return app


@pytest.fixture
def kube_api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[FakeKubeAPI, int]]:
    """A fake API server's port and a kubeconfig that points the client at it."""
    port = free_port()
    (tmp_path / "kubeconfig").write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: test\n"
        f"clusters:\n- name: fake\n  cluster:\n    server: http://127.0.0.1:{port}\n"
        "users:\n- name: router\n  user:\n    token: not-checked\n"
        "contexts:\n- name: test\n  context:\n    cluster: fake\n    user: router\n")
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "kubeconfig"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    yield FakeKubeAPI(), port


def test_a_pod_is_a_worker_while_it_is_running_ready_and_not_leaving() -> None:
    def v1(d: dict[str, Any]) -> Any:
        return k8s.ApiClient().deserialize(json.dumps(d), "V1Pod", "application/json")

    assert pod_worker(v1(pod("a", 31000)), 30000) == WorkerEntry("http://127.0.0.1:31000")
    no_port = pod("a", 1)
    del no_port["metadata"]["annotations"]["radixserve.io/port"]
    assert pod_worker(v1(no_port), 30000) == WorkerEntry("http://127.0.0.1:30000")
    assert pod_worker(v1(pod("a", 1, ip="fd00::7")), 1) == WorkerEntry("http://[fd00::7]:1")
    assert pod_worker(v1(pod("p", 1, labels={"radixserve.io/role": "prefill"},
                             annotations={"radixserve.io/bootstrap-port": "8998"})), 1) == \
        WorkerEntry("http://127.0.0.1:1", "prefill", 8998)
    for out in (pod("a", 1, ready=False), pod("a", 1, phase="Pending"), pod("a", 1, terminating=True)):
        assert pod_worker(v1(out), 30000) is None
    for bad, message in ((pod("a", 1, labels={"radixserve.io/role": "gpu"}), "role"),
                         (pod("a", 1, annotations={"radixserve.io/port": "http"}), "radixserve.io/port"),
                         (pod("a", 1, annotations={"radixserve.io/bootstrap-port": "0"}), "bootstrap-port")):
        with pytest.raises(ValueError, match=message):
            pod_worker(v1(bad), 30000)


def test_a_router_follows_the_pods(kube_api: tuple[FakeKubeAPI, int]) -> None:
    api, api_port = kube_api

    async def scenario(fleet: Fleet, client: aiohttp.ClientSession) -> None:
        await fleet.stub(api.app(), port=api_port)
        ports = [free_port() for _ in range(3)]
        a, b, c = [await fleet.stub(port=p) for p in ports]
        api.put(pod("pod-a", ports[0]))
        api.put(pod("pod-b", ports[1], phase="Pending"))
        api.put(pod("other", ports[2], labels={"app": "other"}))  # not selected
        api.put(pod("elsewhere", ports[2], namespace="default"))  # another namespace
        api.put(pod("bad", ports[2], labels={"radixserve.io/role": "gpu"}))  # refused, logged
        router = await fleet.start_router([], policy="round_robin", discovery_provider="kubernetes",
                                          discovery_namespace=NAMESPACE, discovery_interval_secs=1.0)
        assert set(router.workers) == {a}  # the first list is in before the first request
        assert api.lists == 1  # and the watch starts from it (no second list)

        api.put(pod("pod-b", ports[1], ready=False))  # scheduled, not ready yet
        await asyncio.sleep(0.3)
        assert set(router.workers) == {a}
        api.put(pod("pod-b", ports[1]))  # ready: a watch event brings it in
        await fleet.until_workers({a, b})
        answered = {(await post(client, f"{fleet.url}/generate", {"text": "x"}))[1]["worker"] for _ in range(4)}
        assert len(answered) == 2
        api.put(pod("pod-a", ports[0], terminating=True))  # being deleted: leaves before it is gone
        await fleet.until_workers({b})
        api.fail(True)  # the API server down: nothing changes, the errors are counted
        await asyncio.sleep(1.5)
        assert set(router.workers) == {b} and router.fleet.discovery.errors >= 1
        api.put(pod("pod-c", ports[2]))  # created during the outage: found by the next list
        api.fail(False)
        await fleet.until_workers({b, c})
        api.delete("pod-b")
        await fleet.until_workers({c})
        assert api.lists >= 2  # listed again after the outage

    run(scenario)


def test_prefill_and_decode_pods_join_with_their_roles(kube_api: tuple[FakeKubeAPI, int]) -> None:
    api, api_port = kube_api

    async def scenario(fleet: Fleet, client: aiohttp.ClientSession) -> None:
        await fleet.stub(api.app(), port=api_port)
        pp, dp = free_port(), free_port()
        p = await fleet.stub(create_stub_app(pp, disaggregation_mode="prefill", bootstrap_port=9001), port=pp)
        d = await fleet.stub(create_stub_app(dp, disaggregation_mode="decode"), port=dp)
        api.put(pod("prefill-0", pp, labels={"radixserve.io/role": "prefill"},
                    annotations={"radixserve.io/bootstrap-port": "9001"}))
        api.put(pod("decode-0", dp, labels={"radixserve.io/role": "decode"}))
        router = await fleet.start_router([], pd_disaggregation=True, policy="round_robin",
                                          discovery_provider="kubernetes", discovery_namespace=NAMESPACE,
                                          discovery_interval_secs=1.0)
        assert {u: (w.role, w.bootstrap_port) for u, w in router.workers.items()} == {
            p: ("prefill", 9001), d: ("decode", None)}
        status, body = await post(client, f"{fleet.url}/generate", {"text": "x"})
        assert status == 200 and body["worker"] == dp  # the decode side answers

    run(scenario)


def test_without_credentials_the_router_does_not_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    args = RouterArgs(discovery_provider="kubernetes", port=free_port())
    assert run_router(args) == 1  # what `radixserve router` exits with
    assert "cannot start" in caplog.text and "no Kubernetes credentials" in caplog.text
