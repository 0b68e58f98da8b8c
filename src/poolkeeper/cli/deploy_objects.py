"""The Kubernetes objects of a poolkeeper deployment, as plain dicts (pure; `manifests.py` writes
them): RBAC and the EPP (ConfigMap, Deployment, PodDisruptionBudget, Service), parameterised by
namespace, pool and image. The example pool and Gateways are in `deploy_examples.py`.

- RBAC is least privilege, exactly what the Kubernetes source, the status writer and the Lease
  use: read pools, models and Pods; patch/update model status; create the Lease, then read and
  update only that one by name. No events, no secrets, no cluster scope.
- The EPP Deployment runs 2 replicas (active-active routing, one status writer by Lease), gRPC
  probes on the health port (`liveness`, `readiness` services), a PodDisruptionBudget, and a
  termination grace period longer than the drain grace (streams finish before SIGKILL).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from poolkeeper import __version__
from poolkeeper.api import model as im
from poolkeeper.api.names import dns1123_label_errors
from poolkeeper.controller.kubernetes.objects import watched_resources

EXT_PROC_PORT = 9002
HEALTH_PORT = 9003
METRICS_PORT = 9090
MODEL_PORT = 8000
DRAIN_GRACE_S = 120  # the longest stream we wait for on shutdown
TERMINATION_GRACE_S = DRAIN_GRACE_S + 15
DEFAULT_IMAGE = f"poolkeeper:{__version__}"
DEFAULT_MODEL = "meta-llama/Llama-3.1-8B-Instruct"


@dataclass(frozen=True, slots=True)
class DeployParams:
    namespace: str = "default"
    pool: str = "llm-pool"
    image: str = DEFAULT_IMAGE
    model: str = DEFAULT_MODEL
    replicas: int = 2

    @property
    def epp(self) -> str:
        return f"{self.pool}-epp"

    @property
    def lease(self) -> str:
        return f"{self.pool}-epp"


def param_problems(p: DeployParams) -> list[str]:
    """Names must be DNS labels (the EPP name is `<pool>-epp`)."""
    problems = [f"--namespace {p.namespace!r}: {e}" for e in dns1123_label_errors(p.namespace)]
    problems += [f"--pool {p.pool!r}: {e}" for e in dns1123_label_errors(p.epp)]
    if not p.image.strip():
        problems.append("--image must not be empty")
    return problems


def meta(name: str, p: DeployParams, **extra: Any) -> dict[str, Any]:
    return {"name": name, "namespace": p.namespace, **extra}


def _labels(p: DeployParams) -> dict[str, str]:
    return {"app.kubernetes.io/name": "poolkeeper", "app.kubernetes.io/instance": p.epp}


# The rules the controller needs, and nothing else (tests assert this table exactly).
def role_rules(p: DeployParams) -> list[dict[str, Any]]:
    read = ["get", "list", "watch"]
    return [
        {"apiGroups": [""], "resources": ["pods"], "verbs": read},
        *(
            {"apiGroups": [group], "resources": plurals, "verbs": read}
            for group, plurals in watched_resources().items()
        ),
        {
            "apiGroups": [im.GROUP],
            "resources": ["inferencemodels/status"],
            "verbs": ["patch", "update"],
        },
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "resourceNames": [p.lease],
            "verbs": ["get", "update"],
        },
    ]


def rbac(p: DeployParams) -> list[dict[str, Any]]:
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta(p.epp, p)},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": meta(p.epp, p),
            "rules": role_rules(p),
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": meta(p.epp, p),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": p.epp},
            "subjects": [{"kind": "ServiceAccount", "name": p.epp, "namespace": p.namespace}],
        },
    ]


GATEWAY_CONFIG = """\
apiVersion: poolkeeper.dev/v1alpha1
kind: GatewayConfig
metadata:
  name: default
spec:
  listeners:
    address: 0.0.0.0
    extProc: 9002
    health: 9003
    metrics: 9090
"""


def epp(p: DeployParams) -> list[dict[str, Any]]:
    labels = _labels(p)
    args = [
        "serve",
        "--kubernetes",
        "--pool",
        p.pool,
        "--namespace",
        p.namespace,
        "--lease-name",
        p.lease,
        "-f",
        "/etc/poolkeeper/gatewayconfig.yaml",
        "--drain-grace",
        str(DRAIN_GRACE_S),
        "--log-format",
        "json",
    ]
    container = {
        "name": "epp",
        "image": p.image,
        "imagePullPolicy": "IfNotPresent",
        "args": args,
        "env": [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        ],
        "ports": [
            {"name": "ext-proc", "containerPort": EXT_PROC_PORT, "protocol": "TCP"},
            {"name": "health", "containerPort": HEALTH_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"},
        ],
        "livenessProbe": {
            "grpc": {"port": HEALTH_PORT, "service": "liveness"},
            "periodSeconds": 10,
            "failureThreshold": 3,
        },
        "readinessProbe": {
            "grpc": {"port": HEALTH_PORT, "service": "readiness"},
            "periodSeconds": 2,
            "failureThreshold": 3,
        },
        "startupProbe": {
            "grpc": {"port": HEALTH_PORT, "service": "liveness"},
            "periodSeconds": 2,
            "failureThreshold": 30,
        },
        "resources": {
            "requests": {"cpu": "500m", "memory": "256Mi"},
            "limits": {"memory": "1Gi"},
        },
        "securityContext": {
            "runAsNonRoot": True,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [
            {"name": "config", "mountPath": "/etc/poolkeeper", "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta(p.epp, p, labels=labels),
        "spec": {
            "replicas": p.replicas,
            "selector": {"matchLabels": labels},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
            },
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "serviceAccountName": p.epp,
                    "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": 65532,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    "topologySpreadConstraints": [
                        {
                            "maxSkew": 1,
                            "topologyKey": "kubernetes.io/hostname",
                            "whenUnsatisfiable": "ScheduleAnyway",
                            "labelSelector": {"matchLabels": labels},
                        }
                    ],
                    "containers": [container],
                    "volumes": [
                        {"name": "config", "configMap": {"name": p.epp}},
                        {"name": "tmp", "emptyDir": {}},
                    ],
                },
            },
        },
    }
    return [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": meta(p.epp, p, labels=labels),
            "data": {"gatewayconfig.yaml": GATEWAY_CONFIG},
        },
        deployment,
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": meta(p.epp, p, labels=labels),
            "spec": {"minAvailable": 1, "selector": {"matchLabels": labels}},
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": meta(p.epp, p, labels=labels),
            "spec": {
                "selector": labels,
                "ports": [
                    {
                        "name": "grpc-ext-proc",
                        "port": EXT_PROC_PORT,
                        "targetPort": "ext-proc",
                        "protocol": "TCP",
                        "appProtocol": "http2",
                    },
                    {
                        "name": "http-metrics",
                        "port": METRICS_PORT,
                        "targetPort": "metrics",
                        "protocol": "TCP",
                    },
                ],
            },
        },
    ]
