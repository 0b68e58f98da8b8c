"""deploy/: generated, valid against the Kubernetes schemas, least-privilege RBAC.

- Built-in kinds are validated with kubernetes-validate (strict: unknown fields are errors).
- The CRDs are the project's own (`poolkeeper crds`); the example pool and models are
  validated by the project's loader and by the CRDs' openAPIV3Schema (jsonschema).
- Gateway and HTTPRoute have no schema available offline: their references are checked.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from poolkeeper.api.crds import custom_resource_definitions
from poolkeeper.api.load import load_paths
from poolkeeper.cli.dashboard import PANELS
from poolkeeper.cli.deploy_objects import role_rules
from poolkeeper.cli.deploy_params import DRAIN_GRACE_S, TERMINATION_GRACE_S, DeployParams
from poolkeeper.cli.main import main
from poolkeeper.config.gateway import GatewayConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S_VERSION = "1.32.0"
NOT_BUILT_IN = {
    "InferencePool",
    "InferenceModel",
    "Gateway",
    "HTTPRoute",
    "GatewayClass",
    "DestinationRule",
    "HealthCheckPolicy",
    "GCPBackendPolicy",
}
PROVIDERS = ["envoy-gateway", "istio", "kgateway", "gke", "nginx-gateway-fabric"]


def docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]


def all_docs() -> list[dict[str, Any]]:
    return [d for p in sorted(DEPLOY.rglob("*.yaml")) for d in docs(str(p.relative_to(DEPLOY)))]


def test_deploy_is_what_the_generator_writes(tmp_path: Path) -> None:
    assert main(["manifests", "--out", str(tmp_path)]) == 0
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    committed = sorted(
        str(p.relative_to(DEPLOY))
        for p in DEPLOY.rglob("*")
        if p.is_file() and p.name != "Dockerfile"
    )
    assert written == committed
    for name in written:
        assert (tmp_path / name).read_text() == (DEPLOY / name).read_text(), (
            f"deploy/{name} is stale: run `poolkeeper manifests --out deploy`"
        )


def test_built_in_kinds_validate_strictly() -> None:
    checked = 0
    for doc in all_docs():
        if doc.get("kind") in NOT_BUILT_IN or doc.get("kind") == "Kustomization":
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        checked += 1
    assert checked >= 10


def test_crds_are_the_projects_own() -> None:
    own, upstream = docs("crds.yaml"), docs("upstream/inferencepool-crd.yaml")
    assert own + upstream == custom_resource_definitions()
    # `kubectl apply -k` never touches the GA InferencePool CRD (the Gateway's install owns it).
    assert {c["spec"]["group"] for c in own} == {"inference.networking.x-k8s.io", "llm-d.ai"}
    assert [c["metadata"]["name"] for c in upstream] == [
        "inferencepools.inference.networking.k8s.io"
    ]
    resources = docs("kustomization.yaml")[0]["resources"]
    assert not any("upstream" in r for r in resources)
    assert "kubectl get crd inferencepools.inference.networking.k8s.io ||" in (
        (DEPLOY / "upstream" / "inferencepool-crd.yaml").read_text()
    )


def _crd_schema(group: str, version: str, kind: str) -> dict[str, Any]:
    for crd in custom_resource_definitions():
        if crd["spec"]["group"] == group and crd["spec"]["names"]["kind"] == kind:
            for v in crd["spec"]["versions"]:
                if v["name"] == version:
                    schema: dict[str, Any] = v["schema"]["openAPIV3Schema"]
                    return schema
    raise KeyError((group, version, kind))


def test_example_pool_and_models_are_valid() -> None:
    result = load_paths([DEPLOY / "example" / "pool.yaml"])
    assert result.errors == []
    assert len(result.pools()) == 1
    assert len(result.models()) == 2
    for doc in docs("example/pool.yaml"):
        if doc["kind"] in ("InferencePool", "InferenceModel"):
            group, version = doc["apiVersion"].split("/")
            jsonschema.validate(doc, _crd_schema(group, version, doc["kind"]))
    pool = result.pools()[0]
    epp = next(d for d in docs("epp.yaml") if d["kind"] == "Service")
    assert pool.endpoint_picker().name == epp["metadata"]["name"]
    server = next(d for d in docs("example/pool.yaml") if d["kind"] == "Deployment")
    assert pool.matches(server["spec"]["template"]["metadata"]["labels"])


@pytest.mark.parametrize("provider", PROVIDERS)
def test_gateway_routes_point_at_the_pool(provider: str) -> None:
    objs = {d["kind"]: d for d in docs(f"gateway/{provider}.yaml")}
    route, gateway = objs["HTTPRoute"], objs["Gateway"]
    assert route["spec"]["parentRefs"] == [{"name": gateway["metadata"]["name"]}]
    backend = route["spec"]["rules"][0]["backendRefs"][0]
    pool = next(d for d in docs("example/pool.yaml") if d["kind"] == "InferencePool")
    assert (backend["group"], backend["kind"], backend["name"]) == (
        pool["apiVersion"].split("/")[0],
        "InferencePool",
        pool["metadata"]["name"],
    )


def test_rbac_verb_table_is_exactly_what_the_controller_uses() -> None:
    role = next(d for d in docs("rbac.yaml") if d["kind"] == "Role")
    table = sorted(
        (group, resource, tuple(sorted(rule["verbs"])), tuple(rule.get("resourceNames", ())))
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    )
    x, ga, lease = "inference.networking.x-k8s.io", "inference.networking.k8s.io", "llm-pool-epp"
    assert table == sorted(
        [
            ("", "pods", ("get", "list", "watch"), ()),
            (x, "inferencepools", ("get", "list", "watch"), ()),
            (x, "inferencemodels", ("get", "list", "watch"), ()),
            (x, "inferenceobjectives", ("get", "list", "watch"), ()),
            (x, "inferencemodelrewrites", ("get", "list", "watch"), ()),
            ("llm-d.ai", "inferenceobjectives", ("get", "list", "watch"), ()),
            ("llm-d.ai", "inferencemodelrewrites", ("get", "list", "watch"), ()),
            (ga, "inferencepools", ("get", "list", "watch"), ()),
            (x, "inferencemodels/status", ("patch", "update"), ()),
            ("coordination.k8s.io", "leases", ("create",), ()),
            ("coordination.k8s.io", "leases", ("get", "update"), (lease,)),
        ]
    )
    assert role["rules"] == role_rules(DeployParams())
    kinds = {d["kind"] for d in all_docs()}
    assert "ClusterRole" not in kinds
    assert "ClusterRoleBinding" not in kinds


def test_epp_deployment_shape() -> None:
    objs = {d["kind"]: d for d in docs("epp.yaml") if d["metadata"]["name"] == "llm-pool-epp"}
    spec = objs["Deployment"]["spec"]
    pod = spec["template"]["spec"]
    container = pod["containers"][0]
    assert spec["replicas"] == 2
    assert objs["PodDisruptionBudget"]["spec"]["minAvailable"] == 1
    assert pod["terminationGracePeriodSeconds"] == TERMINATION_GRACE_S > DRAIN_GRACE_S
    assert container["args"][container["args"].index("--drain-grace") + 1] == str(DRAIN_GRACE_S)
    assert container["readinessProbe"]["grpc"] == {"port": 9003, "service": "readiness"}
    assert container["livenessProbe"]["grpc"] == {"port": 9003, "service": "liveness"}
    lease = container["args"][container["args"].index("--lease-name") + 1]
    assert lease == "llm-pool-epp"
    config = GatewayConfig.model_validate(
        yaml.safe_load(objs["ConfigMap"]["data"]["gatewayconfig.yaml"])
    )
    assert config.spec.listeners.address == "0.0.0.0"
    ports = {p["name"]: p["port"] for p in objs["Service"]["spec"]["ports"]}
    assert ports == {"grpc-ext-proc": config.spec.listeners.ext_proc, "http-metrics": 9090}
    # Cross-replica sync: on, keyed by an optional Secret the operator creates (no key here).
    sync = config.spec.replica_sync
    assert sync.enabled is True
    assert sync.key_optional is True  # before the Secret exists the replicas route alone
    (peers,) = [d for d in docs("epp.yaml") if d["metadata"]["name"] == "llm-pool-epp-peers"]
    assert peers["spec"]["clusterIP"] == "None"
    assert sync.service_address() == ("llm-pool-epp-peers.default.svc", sync.port)
    assert peers["spec"]["ports"] == [
        {"name": "sync", "port": sync.port, "targetPort": "sync", "protocol": "UDP"}
    ]
    (volume,) = [v for v in pod["volumes"] if "secret" in v]
    assert volume["secret"] == {"secretName": "llm-pool-epp-sync", "optional": True}
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    assert sync.key_file == f"{mount['mountPath']}/key"


def test_only_the_epps_pods_reach_its_sync_port() -> None:
    objs = {d["kind"]: d for d in docs("epp.yaml") if d["metadata"]["name"] == "llm-pool-epp"}
    labels = objs["Deployment"]["spec"]["template"]["metadata"]["labels"]
    container = objs["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    (sync_port,) = [p for p in container["ports"] if p["name"] == "sync"]
    (policy,) = [d for d in docs("epp.yaml") if d["kind"] == "NetworkPolicy"]
    spec = policy["spec"]
    assert spec["podSelector"] == {"matchLabels": labels}
    assert spec["policyTypes"] == ["Ingress"]
    open_to_all, sync_only = spec["ingress"]
    assert open_to_all == {"ports": [{"protocol": "TCP"}]}  # every TCP port as before
    assert all(p["protocol"] == "TCP" for p in container["ports"] if p["name"] != "sync")
    assert sync_only["from"] == [{"podSelector": {"matchLabels": labels}}]
    assert sync_only["ports"] == [{"protocol": "UDP", "port": sync_port["containerPort"]}]


def test_dashboard_queries_name_exported_metrics() -> None:
    board = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    assert len(board["panels"]) == len(PANELS)
    from prometheus_client import generate_latest

    from poolkeeper.telemetry.metrics import GatewayMetrics
    from poolkeeper.telemetry.pool_collector import PoolStats

    metrics = GatewayMetrics(pool_stats=lambda: iter([PoolStats("p", 0.0, 0.0, 1)]))
    exported = generate_latest(metrics.registry).decode()
    for panel in board["panels"]:
        for target in panel["targets"]:
            names = [w for w in _words(target["expr"]) if w.startswith("inference_")]
            assert names, target["expr"]
            for name in names:
                base = name.removesuffix("_bucket").removesuffix("_sum")
                assert f"# TYPE {base} " in exported or f"# TYPE {name} " in exported, name


def _words(expr: str) -> list[str]:
    for ch in "()[],{}":
        expr = expr.replace(ch, " ")
    return expr.split()


def test_manifests_for_another_namespace_and_pool(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["manifests", "-n", "llm", "--pool", "qwen", "--gateway", "istio"]) == 0
    out = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    namespaced = [d for d in out if d["kind"] != "CustomResourceDefinition"]
    assert {d["metadata"]["namespace"] for d in namespaced} == {"llm"}
    assert any(d["kind"] == "HTTPRoute" for d in out)
    role = next(d for d in out if d["kind"] == "Role")
    assert role["rules"][-1]["resourceNames"] == ["qwen-epp"]
    assert main(["manifests", "--pool", "Not_A_Name"]) == 2
    assert "--pool 'Not_A_Name'" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize(
    ("directory", "files"),
    [("", ["crds.yaml", "rbac.yaml", "epp.yaml"]), ("example", ["example/pool.yaml"])],
)
def test_kustomizations_build(directory: str, files: list[str]) -> None:
    result = subprocess.run(
        ["kubectl", "kustomize", str(DEPLOY / directory)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    built = [d for d in yaml.safe_load_all(result.stdout) if d]
    assert len(built) == sum(len(docs(f)) for f in files)


def test_provider_extras_point_at_the_epp_and_the_pool() -> None:
    epp = next(d for d in docs("epp.yaml") if d["kind"] == "Service")["metadata"]
    (rule,) = [d for d in docs("gateway/istio.yaml") if d["kind"] == "DestinationRule"]
    assert rule["spec"]["host"] == f"{epp['name']}.{epp['namespace']}.svc.cluster.local"
    assert rule["spec"]["trafficPolicy"]["tls"] == {"mode": "SIMPLE", "insecureSkipVerify": True}
    pool = next(d for d in docs("example/pool.yaml") if d["kind"] == "InferencePool")
    for policy in docs("gateway/gke.yaml"):
        if policy["kind"] in ("HealthCheckPolicy", "GCPBackendPolicy"):
            ref = policy["spec"]["targetRef"]
            assert (ref["group"], ref["kind"], ref["name"]) == (
                pool["apiVersion"].split("/")[0],
                "InferencePool",
                pool["metadata"]["name"],
            )
    classes = {
        p: next(d for d in docs(f"gateway/{p}.yaml") if d["kind"] == "Gateway")["spec"][
            "gatewayClassName"
        ]
        for p in PROVIDERS
    }
    assert classes == {
        "envoy-gateway": "envoy-gateway",
        "istio": "istio",
        "kgateway": "kgateway",
        "gke": "gke-l7-regional-external-managed",
        "nginx-gateway-fabric": "nginx",
    }


def test_dockerfile_has_a_slim_kubernetes_target_without_envoy() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    stages = [line.split()[-1] for line in text.splitlines() if line.startswith("FROM ")]
    assert stages == ["build", "kubernetes", "full"]  # full last: the default target
    slim = text.split("AS kubernetes")[1].split("FROM ")[0]
    assert "/install-kubernetes" in slim
    assert "rm -f /install-kubernetes/lib/python3.11/site-packages/envoy/_bin/envoy" in text


def test_no_key_or_secret_is_shipped() -> None:
    """Sync is on in deploy/, but its key is the operator's: a Secret in a committed (public)
    file would be every user's key."""
    for path in sorted(DEPLOY.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            assert doc is None or doc.get("kind") != "Secret", path
    text = (DEPLOY / "epp.yaml").read_text()
    assert "head -c 32 /dev/urandom" in text  # the ConfigMap says how to make one
