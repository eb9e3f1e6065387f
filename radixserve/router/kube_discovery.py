"""Workers found as Kubernetes pods (``--discovery-provider kubernetes``): pods come and go live.

The router lists the pods of ``--discovery-namespace`` that match ``--discovery-selector`` (a
label selector, ``app=radixserve-worker``) through the Kubernetes API with the ``kubernetes``
client, then watches them. A pod is a worker while it is ``Running``, ``Ready`` (its readiness
probe, ``/health``, passes: a draining worker answers 503 there and leaves at once), has an IP, and
is not being deleted. Its URL is ``http://<pod IP>:<port>``, the port from the pod's
``radixserve.io/port`` annotation, else ``--discovery-port``. For prefill/decode disaggregation the
pod's ``radixserve.io/role`` label says ``prefill`` or ``decode``, and a prefill pod's
``radixserve.io/bootstrap-port`` annotation its bootstrap port (else the router asks the worker).

How it follows the pods: one thread (the client is synchronous) lists them, then watches from the
list's ``resourceVersion`` for ``--discovery-interval-secs``, applying each event to its own copy
of the pods; when the watch ends (its timeout, a ``410 Gone``, a dropped connection) it lists
again, so a missed event lasts at most one interval. After every change the thread hands the
router's event loop the full list of workers, which ``Reconciler`` applies (the file provider's
last step). An API error changes nothing (logged, counted in ``errors``) and the thread retries
after an interval: an API server that is down never empties the fleet.

Credentials: in a pod, its service account (``KUBERNETES_SERVICE_HOST`` set); elsewhere the
kubeconfig (``KUBECONFIG`` or ``~/.kube/config``). deploy/kubernetes/ has the RBAC it needs
(get, list and watch on pods).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from typing import Any

from radixserve.router.discovery import DiscoveryError, FleetLike, Reconciler, WorkerEntry

logger = logging.getLogger("radixserve.router")

PORT_ANNOTATION = "radixserve.io/port"
BOOTSTRAP_PORT_ANNOTATION = "radixserve.io/bootstrap-port"
ROLE_LABEL = "radixserve.io/role"
SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def default_namespace() -> str:
    """The router pod's own namespace, else ``default``."""
    try:
        with open(SERVICE_ACCOUNT_NAMESPACE) as f:
            return f.read().strip() or "default"
    except OSError:
        return "default"


def _port(value: Any, what: str) -> int:
    try:
        port = int(value)
    except (TypeError, ValueError):
        port = 0
    if not 0 < port < 65536:
        raise ValueError(f"{what} must be a port number, got {value!r}")
    return port


def pod_worker(pod: Any, default_port: int) -> WorkerEntry | None:
    """The worker a pod (a ``V1Pod``) stands for, or None while it is not one (not running, not
    ready, no IP yet, being deleted). ``ValueError`` for a pod whose annotations or role are wrong."""
    meta, status = pod.metadata, pod.status
    if meta is None or status is None or meta.deletion_timestamp is not None:
        return None
    if status.phase != "Running" or not status.pod_ip:
        return None
    if not any(c.type == "Ready" and c.status == "True" for c in status.conditions or ()):
        return None
    labels, notes = meta.labels or {}, meta.annotations or {}
    name = f"pod {meta.namespace}/{meta.name}"
    port = _port(notes.get(PORT_ANNOTATION, default_port), f"{name}: {PORT_ANNOTATION}")
    role = labels.get(ROLE_LABEL)
    if role not in (None, "prefill", "decode"):
        raise ValueError(f"{name}: label {ROLE_LABEL} must be prefill or decode, got {role!r}")
    boot = notes.get(BOOTSTRAP_PORT_ANNOTATION)
    bootstrap = _port(boot, f"{name}: {BOOTSTRAP_PORT_ANNOTATION}") if boot is not None else None
    ip = status.pod_ip
    host = f"[{ip}]" if ":" in ip else ip
    return WorkerEntry(f"http://{host}:{port}", role, bootstrap)


def api_client() -> Any:
    """A ``CoreV1Api`` with the pod's service account, else the kubeconfig's credentials."""
    try:
        from kubernetes import client, config
    except ImportError:  # pragma: no cover - the extra is part of the standard set-up
        raise DiscoveryError("--discovery-provider kubernetes needs the kubernetes client: "
                           "pip install 'radixserve[kubernetes]'") from None
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config()
    else:
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))  # read now, not at import
    return client.CoreV1Api()


class KubernetesDiscovery(Reconciler):
    def __init__(self, fleet: FleetLike, selector: str, namespace: str | None, port: int,
                 interval: float) -> None:
        super().__init__(fleet)
        self.selector = selector
        self.namespace = namespace or default_namespace()
        self.port = port
        self.interval = interval
        self.source = f"kubernetes discovery ({self.namespace}, {selector})"
        self.pods: dict[str, Any] = {}  # name -> the pod as last listed or watched
        self.api: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lists: asyncio.Queue[list[WorkerEntry]] = asyncio.Queue()
        self._stopping = threading.Event()
        self._watch: Any = None

    def workers(self) -> list[WorkerEntry]:
        out = []
        for name in sorted(self.pods):
            try:
                entry = pod_worker(self.pods[name], self.port)
            except ValueError as e:
                logger.warning("%s: %s; the pod is left out", self.source, e)
                continue
            if entry is not None:
                out.append(entry)
        return out

    def _list(self) -> str:
        """Replace the pods with a fresh list; the list's resourceVersion, to watch from."""
        res = self.api.list_namespaced_pod(self.namespace, label_selector=self.selector,
                                           _request_timeout=30)
        self.pods = {p.metadata.name: p for p in res.items}
        return str(res.metadata.resource_version or "")

    def _hand_over(self) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._lists.put_nowait, self.workers())

    def _follow(self, version: str | None) -> None:
        """The thread: watch from ``version`` (the last list's) for an interval, list again, and so
        on; an error waits an interval and lists."""
        from kubernetes import watch

        while not self._stopping.is_set():
            try:
                if version is None:
                    version = self._list()
                    self._hand_over()
                self._watch = watch.Watch()
                for ev in self._watch.stream(self.api.list_namespaced_pod, self.namespace,
                                             label_selector=self.selector, resource_version=version,
                                             timeout_seconds=max(1, round(self.interval)),
                                             _request_timeout=self.interval + 30):
                    pod = ev["object"]
                    if ev["type"] == "DELETED":
                        self.pods.pop(pod.metadata.name, None)
                    elif ev["type"] in ("ADDED", "MODIFIED"):
                        self.pods[pod.metadata.name] = pod
                    else:
                        continue
                    self._hand_over()
            except Exception as e:  # the API server down or refusing: keep the fleet, try again later
                if self._stopping.is_set():
                    return
                self.errors += 1
                why = (str(e).splitlines() or [type(e).__name__])[0]
                logger.warning("%s: %s; the fleet is left as it is", self.source, why)
                self._stopping.wait(self.interval)
            version = None  # the watch ended (its timeout, 410 Gone, an error): list again

    async def sync(self) -> None:
        """Connect, take the first list and apply it (before the router takes requests), then start
        following the pods."""
        self._loop = asyncio.get_running_loop()
        try:
            self.api = await asyncio.to_thread(api_client)
        except DiscoveryError:
            raise
        except Exception as e:  # no in-cluster service account and no usable kubeconfig
            raise DiscoveryError(f"{self.source}: no Kubernetes credentials: {e}") from None
        version = None
        try:
            version = await asyncio.to_thread(self._list)
            await self.apply(self.workers())
        except Exception as e:
            self.errors += 1
            logger.warning("%s: the first list failed (%s); following the pods from now on", self.source, e)
        threading.Thread(target=self._follow, args=(version,), name="kube-discovery", daemon=True).start()

    async def run(self) -> None:
        while True:
            entries = await self._lists.get()
            while not self._lists.empty():  # a burst of events: only the newest list matters
                entries = self._lists.get_nowait()
            await self.apply(entries)

    def stop(self) -> None:
        self._stopping.set()
        if self._watch is not None:
            self._watch.stop()
