"""The Kubernetes objects of a poolkeeper deployment, as plain dicts (pure; `manifests.py` writes
them): RBAC and the EPP (ConfigMap, Deployment, PodDisruptionBudget, Service), parameterised by
namespace, pool and image. The example pool and Gateways are in `deploy_examples.py`.

- RBAC is least privilege, exactly what the Kubernetes source, the status writer and the Lease
  use: read pools, models and Pods; patch/update model status; create the Lease, then read and
  update only that one by name. No events, no secrets, no cluster scope.
- The EPP Deployment runs 2 replicas (active-active routing, one status writer by Lease), gRPC
  probes on the health port (`liveness`, `readiness` services), a PodDisruptionBudget, and a
  termination grace period longer than the drain timeout plus the drain grace (after SIGTERM
  readiness turns NOT_SERVING and the Lease is released at once, ext_proc keeps taking streams
  for 30 s while the Gateway notices, then streams get 120 s to finish before SIGKILL).
- Cross-replica sync is prepared but off: a UDP port, a headless Service naming every replica
  (`<pool>-epp-peers`), an optional Secret `<pool>-epp-sync` mounted for its key, and
  `replicaSync` in the GatewayConfig with `enabled: false` (on, a missing key would stop the
  start: the syncer never runs unauthenticated).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from poolkeeper import __version__
from poolkeeper.api import model as im
from poolkeeper.api.names import dns1123_label_errors
from poolkeeper.controller.kubernetes.objects import watched_resources
from poolkeeper.scheduling.replicasync.config import DEFAULT_PORT as DEFAULT_SYNC_PORT

EXT_PROC_PORT = 9002
HEALTH_PORT = 9003
METRICS_PORT = 9090
MODEL_PORT = 8000
DRAIN_TIMEOUT_S = 30  # after SIGTERM ext_proc keeps taking streams this long (upstream's)
DRAIN_GRACE_S = 120  # then the longest stream we wait for on shutdown
TERMINATION_GRACE_S = DRAIN_TIMEOUT_S + DRAIN_GRACE_S + 15
SYNC_PORT = DEFAULT_SYNC_PORT  # UDP, cross-replica sync (spec.replicaSync)
SYNC_KEY_DIR = "/etc/poolkeeper-sync"
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

    @property
    def peers_service(self) -> str:
        return f"{self.pool}-epp-peers"

    @property
    def sync_secret(self) -> str:
        return f"{self.pool}-epp-sync"


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


def gateway_config(p: DeployParams) -> str:
    """The EPP's GatewayConfig: its listeners, and cross-replica sync ready to turn on."""
    return f"""\
apiVersion: poolkeeper.dev/v1alpha1
kind: GatewayConfig
metadata:
  name: default
spec:
  listeners:
    address: 0.0.0.0
    extProc: {EXT_PROC_PORT}
    health: {HEALTH_PORT}
    metrics: {METRICS_PORT}
  # Cross-replica sync (docs/kubernetes.md, "Active-active replicas with sync"): create the
  # Secret {p.sync_secret} with a shared key, then set enabled: true.
  replicaSync:
    enabled: false
    port: {SYNC_PORT}
    peerService: {p.peers_service}.{p.namespace}.svc
    keyFile: {SYNC_KEY_DIR}/key
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
        "--drain-timeout",
        str(DRAIN_TIMEOUT_S),
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
            {"name": "sync", "containerPort": SYNC_PORT, "protocol": "UDP"},
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
            {"name": "sync-key", "mountPath": SYNC_KEY_DIR, "readOnly": True},
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
                        # Optional: without the Secret the pod starts, and sync stays off.
                        {
                            "name": "sync-key",
                            "secret": {"secretName": p.sync_secret, "optional": True},
                        },
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
            "data": {"gatewayconfig.yaml": gateway_config(p)},
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
        {
            # Headless: its name resolves to every replica's Pod IP (replicaSync.peerService);
            # starting replicas too, so they hear the others' sends before taking traffic.
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": meta(p.peers_service, p, labels=labels),
            "spec": {
                "clusterIP": "None",
                "publishNotReadyAddresses": True,
                "selector": labels,
                "ports": [
                    {"name": "sync", "port": SYNC_PORT, "targetPort": "sync", "protocol": "UDP"}
                ],
            },
        },
        sync_policy(p),
    ]


def sync_policy(p: DeployParams) -> dict[str, Any]:
    """Only the EPP's own Pods may reach its sync port: anyone else's datagrams would cost a
    lookup each (the transport drops non-peers before their tag), but need not arrive at all.
    Every TCP port stays open to all, as without the policy (ext-proc, health, metrics). Takes
    effect where the cluster's network plugin enforces NetworkPolicies."""
    labels = _labels(p)
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta(f"{p.epp}-sync-ingress", p, labels=labels),
        "spec": {
            "podSelector": {"matchLabels": labels},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"ports": [{"protocol": "TCP"}]},
                {
                    "from": [{"podSelector": {"matchLabels": labels}}],
                    "ports": [{"protocol": "UDP", "port": SYNC_PORT}],
                },
            ],
        },
    }
