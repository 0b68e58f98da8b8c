"""The Kubernetes objects of a poolkeeper deployment, as plain dicts (pure; `manifests.py` writes
them): RBAC and the EPP (ConfigMap, Deployment, PodDisruptionBudget, Service), parameterised by
namespace, pool and image (`deploy_params.py`). The example pool and Gateways are in
`deploy_examples.py`, cross-replica sync's objects in `deploy_sync.py`.

- RBAC is least privilege, exactly what the Kubernetes source, the status writer and the Lease
  use: read pools, models and Pods; patch/update model status; create the Lease, then read and
  update only that one by name. No events, no secrets, no cluster scope.
- The EPP Deployment runs 2 replicas (active-active routing, one status writer by Lease), gRPC
  probes on the health port (`liveness`, `readiness` services), a PodDisruptionBudget, and a
  termination grace period longer than the drain timeout plus the drain grace (after SIGTERM
  readiness turns NOT_SERVING and the Lease is released at once, ext_proc keeps taking streams
  for 30 s while the Gateway notices, then streams get 120 s to finish before SIGKILL).
- Cross-replica sync is on, keyed by an optional Secret the operator creates (`deploy_sync.py`
  says why no key is generated here): a UDP port, a headless Service naming every replica
  (`<pool>-epp-peers`), the Secret `<pool>-epp-sync` mounted for its key, and the NetworkPolicy.
"""

from __future__ import annotations

from typing import Any

from poolkeeper.api import model as im
from poolkeeper.cli import deploy_sync as sync
from poolkeeper.cli.deploy_params import (
    DRAIN_GRACE_S,
    DRAIN_TIMEOUT_S,
    EXT_PROC_PORT,
    HEALTH_PORT,
    METRICS_PORT,
    SYNC_PORT,
    TERMINATION_GRACE_S,
    DeployParams,
    labels as _labels,
    meta,
)
from poolkeeper.controller.kubernetes.objects import watched_resources


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
    """The EPP's GatewayConfig: its listeners, and cross-replica sync (`deploy_sync.py`)."""
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
""" + sync.sync_section(p)


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
            sync.key_mount(),
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
                        sync.key_volume(p),
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
        sync.peers_service(p),
        sync.sync_policy(p),
    ]
