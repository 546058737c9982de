"""The Kubernetes manifests (deploy/k8s, a kustomize base) are schema-checked without a cluster
(PyPI `kubernetes-validate`, strict: unknown fields fail) and their shape asserted: gateway replicas
with /ready readiness, a preStop pause and a grace period above the drain, a disruption budget,
GPU workers linked to every replica, the secrets, and the queue-depth autoscaling example.
`kubectl kustomize` renders the base too where kubectl is installed."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from sluice.cli import build_parser
from sluice.settings import ConfigError, load_settings

kubernetes_validate = pytest.importorskip("kubernetes_validate")

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]
K8S = REPO / "deploy" / "k8s"
KUBERNETES_VERSION = "1.30.0"  # the oldest we promise (preStop exec, autoscaling/v2, policy/v1)
KUSTOMIZATION = yaml.safe_load((K8S / "kustomization.yaml").read_text())


def _documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _all() -> dict[tuple[str, str], dict[str, Any]]:
    return {(doc["kind"], doc["metadata"]["name"]): doc
            for name in KUSTOMIZATION["resources"] for doc in _documents(K8S / name)}


def test_the_base_lists_every_manifest_and_each_exists() -> None:
    listed = set(KUSTOMIZATION["resources"])
    present = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == present


@pytest.mark.parametrize("path", sorted([*K8S.glob("*.yaml"), *(K8S / "examples").glob("*.yaml")]),
                         ids=lambda p: p.name)
def test_every_manifest_is_valid_against_the_kubernetes_schema(path: Path) -> None:
    if path.name == "kustomization.yaml":
        return  # not a Kubernetes resource
    for doc in _documents(path):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)  # raises on any fault


def test_kubectl_kustomize_renders_the_base_and_the_result_validates() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (the manifests are still validated one by one)")
    result = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    docs = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    assert len(docs) == sum(len(_documents(K8S / name)) for name in KUSTOMIZATION["resources"])
    for doc in docs:
        assert doc["metadata"].get("namespace", "sluice") == "sluice"
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def _container(kind: str, name: str) -> dict[str, Any]:
    [container] = _all()[(kind, name)]["spec"]["template"]["spec"]["containers"]
    return container


def _gateway_environ() -> dict[str, str]:
    config = _all()[("ConfigMap", "sluice-config")]["data"]
    env = {k: v for k, v in config.items() if k != "SLUICE_CONFIG_DIR"}
    for var in _container("StatefulSet", "sluice-gateway")["env"]:
        env[var["name"]] = "postgresql+asyncpg://u:p@db/sluice" if var["name"] == "SLUICE_DATABASE_URL" else "x" * 32
    return env


def test_gateway_replicas_drain_behind_ready() -> None:
    gateway = _all()[("StatefulSet", "sluice-gateway")]
    assert gateway["spec"]["replicas"] >= 2
    pod = gateway["spec"]["template"]["spec"]
    container = _container("StatefulSet", "sluice-gateway")
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    pause = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pause[0] == "sleep"
    settings = load_settings(REPO / "config", environ=_gateway_environ())
    assert pod["terminationGracePeriodSeconds"] > int(pause[1]) + settings.gateway.drain_timeout_s
    assert settings.shared.url.startswith("redis://")
    args = build_parser().parse_args(container["command"][1:])
    assert callable(args.handler) and args.host == "0.0.0.0"


def test_the_disruption_budget_covers_the_gateways() -> None:
    budget = _all()[("PodDisruptionBudget", "sluice-gateway")]["spec"]
    labels = _all()[("StatefulSet", "sluice-gateway")]["spec"]["template"]["metadata"]["labels"]
    assert budget["selector"]["matchLabels"].items() <= labels.items()
    assert budget.get("maxUnavailable") == 1 or budget.get("minAvailable", 0) >= 1


def test_workers_take_one_gpu_each_and_link_to_every_replica() -> None:
    container = _container("Deployment", "sluice-worker")
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    args = build_parser().parse_args(container["command"][1:])
    gateway = _all()[("StatefulSet", "sluice-gateway")]["spec"]
    expected = [f"sluice-gateway-{i}.{gateway['serviceName']}:8100" for i in range(gateway["replicas"])]
    assert args.gateway.split(",") == expected
    service = _all()[("Service", gateway["serviceName"])]["spec"]
    assert service["clusterIP"] == "None" and 8100 in [p["port"] for p in service["ports"]]


def test_secrets_hold_what_the_pods_read_and_placeholders_are_refused() -> None:
    secret = _all()[("Secret", "sluice-secrets")]["stringData"]
    used = {var["valueFrom"]["secretKeyRef"]["key"]
            for kind, name in (("StatefulSet", "sluice-gateway"), ("Deployment", "sluice-worker"))
            for var in _container(kind, name)["env"] if "valueFrom" in var}
    assert used == {"admin-token", "worker-secret", "metrics-token", "database-url"} == set(secret)
    env = {**_gateway_environ(), "SLUICE_GATEWAY_WORKER_SECRET": secret["worker-secret"]}
    with pytest.raises(ConfigError, match="worker_secret must be at least 16"):
        load_settings(REPO / "config", environ=env)  # an unedited secret.yaml cannot start a gateway


def test_the_autoscaling_example_scales_the_workers_on_queue_depth() -> None:
    [hpa] = _documents(K8S / "examples" / "hpa-worker-queue-depth.yaml")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "sluice-worker"}
    [metric] = hpa["spec"]["metrics"]
    assert metric["external"]["metric"]["name"] == "sluice_requests_waiting"
    assert "sluice:num_requests_waiting" in (K8S / "examples" / "hpa-worker-queue-depth.yaml").read_text()
