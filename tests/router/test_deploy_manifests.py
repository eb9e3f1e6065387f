"""deploy/kubernetes/: every document valid against the Kubernetes 1.37 schemas (strict: no unknown
field), and consistent with radixserve itself: each container's arguments parse as `radixserve
serve` / `radixserve router` options, the routers' selectors pick their workers' pods (and only
them), the port annotations match the workers' ports, the routers' service account may list and
watch pods, and a pod's grace period outlasts the worker's drain."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from radixserve.cli import build_parser
from radixserve.config import ServerArgs
from radixserve.router.config import RouterArgs
from radixserve.router.discovery import provider

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
FILES = sorted(DEPLOY.glob("*.yaml"))


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def all_documents() -> list[dict[str, Any]]:
    return [d for p in FILES for d in documents(p)]


def parsed(container: dict[str, Any]) -> ServerArgs | RouterArgs:
    # $(POD_IP) is filled in by the kubelet; any address stands for it here
    argv = [re.sub(r"\$\([A-Z_]+\)", "10.0.0.7", a) for a in container["args"]]
    ns = build_parser().parse_args(argv)
    return RouterArgs.from_cli_args(ns) if argv[0] == "router" else ServerArgs.from_cli_args(ns)


def selects(selector: str, labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, _, v in (t.partition("=") for t in selector.split(",")))


def test_the_manifests_exist() -> None:
    assert {p.name for p in FILES} >= {"rbac.yaml", "workers.yaml", "router.yaml", "pd.yaml"}


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_every_document_is_valid_against_the_kubernetes_schemas(path: Path) -> None:
    for doc in documents(path):
        kubernetes_validate.validate(doc, "1.37.0", strict=True)
    with pytest.raises(kubernetes_validate.ValidationError):  # the check can fail
        bad = documents(path)[-1]
        bad["spec" if "spec" in bad else "metadata"]["notAField"] = 1
        kubernetes_validate.validate(bad, "1.37.0", strict=True)


def test_the_manifests_agree_with_radixserve() -> None:
    docs = all_documents()
    deployments = [d for d in docs if d["kind"] == "Deployment"]
    workers, routers = [], []
    for d in deployments:
        spec = d["spec"]
        pod_labels = spec["template"]["metadata"]["labels"]
        assert all(pod_labels.get(k) == v for k, v in spec["selector"]["matchLabels"].items())
        (container,) = spec["template"]["spec"]["containers"]
        args = parsed(container)
        if isinstance(args, RouterArgs):
            routers.append((d, args))
        else:
            workers.append((d, args))
            notes = spec["template"]["metadata"]["annotations"]
            assert int(notes["radixserve.io/port"]) == args.port
            assert args.port in {p["containerPort"] for p in container["ports"]}
            assert spec["template"]["spec"]["terminationGracePeriodSeconds"] > args.shutdown_grace_period_secs
            if args.disaggregation_mode == "prefill":
                assert int(notes["radixserve.io/bootstrap-port"]) == args.disaggregation_bootstrap_port
            role = args.disaggregation_mode if args.disaggregation_mode != "null" else None
            assert pod_labels.get("radixserve.io/role") == role
    assert workers and routers
    roles = {r["metadata"]["name"]: r for r in docs if r["kind"] == "Role"}
    bindings = [b for b in docs if b["kind"] == "RoleBinding"]
    accounts = {a["metadata"]["name"] for a in docs if a["kind"] == "ServiceAccount"}
    for d, args in routers:
        assert provider(args) == "kubernetes"
        mine = [(w, wa) for w, wa in workers if selects(args.discovery_selector, w["spec"]["template"]["metadata"]["labels"])]
        assert mine, f"{d['metadata']['name']} selects no worker"
        assert {wa.disaggregation_mode == "null" for _, wa in mine} == {not args.pd_disaggregation}
        assert not selects(args.discovery_selector, d["spec"]["template"]["metadata"]["labels"])
        assert all(wa.port == args.discovery_port for _, wa in mine)
        if args.enable_cache_events:
            assert all(wa.cache_events_port for _, wa in mine)
        account = d["spec"]["template"]["spec"]["serviceAccountName"]
        assert account in accounts
        granted = {verb for b in bindings if any(s["name"] == account for s in b["subjects"])
                   for rule in roles[b["roleRef"]["name"]]["rules"] if "pods" in rule["resources"]
                   for verb in rule["verbs"]}
        assert {"list", "watch"} <= granted
        service = [s for s in docs if s["kind"] == "Service"
                   and selects(",".join(f"{k}={v}" for k, v in s["spec"]["selector"].items()),
                               d["spec"]["template"]["metadata"]["labels"])]
        assert service, f"no Service in front of {d['metadata']['name']}"
