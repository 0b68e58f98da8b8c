"""The example objects of `deploy/`: an InferencePool with two InferenceModels and its model
servers (the poolkeeper simulator as a stand-in for vLLM), and a Gateway + HTTPRoute whose
backendRef is the InferencePool, for each provider: Envoy Gateway, Istio, kgateway, GKE and
NGINX Gateway Fabric (pure dicts, like `deploy_objects.py`)."""

from __future__ import annotations

from typing import Any

from poolkeeper.api import model as im, pool as ip
from poolkeeper.cli.deploy_params import EXT_PROC_PORT, MODEL_PORT, DeployParams, meta


def example_pool(p: DeployParams) -> list[dict[str, Any]]:
    """The InferencePool (GA v1), two InferenceModels, and the pool's model servers (the
    poolkeeper simulator, 3 replicas: swap in vLLM for real GPUs)."""
    pool_ref = {"group": ip.V1_GROUP, "kind": "InferencePool", "name": p.pool}
    model_labels = {"app": p.pool}
    return [
        {
            "apiVersion": ip.V1,
            "kind": "InferencePool",
            "metadata": meta(p.pool, p),
            "spec": {
                "selector": {"matchLabels": model_labels},
                "targetPorts": [{"number": MODEL_PORT}],
                "endpointPickerRef": {
                    "name": p.epp,
                    "port": {"number": EXT_PROC_PORT},
                    "failureMode": "FailClose",
                },
            },
        },
        {
            "apiVersion": im.V1ALPHA2,
            "kind": "InferenceModel",
            "metadata": meta("base-model", p),
            "spec": {"modelName": p.model, "criticality": "Critical", "poolRef": pool_ref},
        },
        {
            "apiVersion": im.V1ALPHA2,
            "kind": "InferenceModel",
            "metadata": meta("chat", p),
            "spec": {
                "modelName": "chat",
                "criticality": "Standard",
                "poolRef": pool_ref,
                "targetModels": [{"name": p.model, "weight": 100}],
            },
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": meta(f"{p.pool}-server", p, labels=model_labels),
            "spec": {
                "replicas": 3,
                "selector": {"matchLabels": model_labels},
                "template": {
                    "metadata": {"labels": model_labels},
                    "spec": {
                        "containers": [
                            {
                                "name": "server",
                                "image": p.image,
                                "args": [
                                    "sim",
                                    "--host",
                                    "0.0.0.0",
                                    "--port",
                                    str(MODEL_PORT),
                                    "--model",
                                    p.model,
                                ],
                                "ports": [{"name": "http", "containerPort": MODEL_PORT}],
                                "readinessProbe": {
                                    "httpGet": {"path": "/health", "port": MODEL_PORT},
                                    "periodSeconds": 2,
                                },
                                "resources": {"requests": {"cpu": "250m", "memory": "128Mi"}},
                                "securityContext": {
                                    "runAsNonRoot": True,
                                    "runAsUser": 65532,
                                    "allowPrivilegeEscalation": False,
                                },
                            }
                        ]
                    },
                },
            },
        },
    ]


def _route(p: DeployParams, gateway: str) -> dict[str, Any]:
    return {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": meta(p.pool, p),
        "spec": {
            "parentRefs": [{"name": gateway}],
            "rules": [
                {
                    "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                    "backendRefs": [
                        {"group": ip.V1_GROUP, "kind": "InferencePool", "name": p.pool}
                    ],
                    "timeouts": {"request": "300s"},
                }
            ],
        },
    }


def _gateway(p: DeployParams, name: str, class_name: str) -> dict[str, Any]:
    return {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "Gateway",
        "metadata": meta(name, p),
        "spec": {
            "gatewayClassName": class_name,
            "listeners": [{"name": "http", "protocol": "HTTP", "port": 80}],
        },
    }


def envoy_gateway(p: DeployParams) -> list[dict[str, Any]]:
    """Envoy Gateway (v1.5+, InferencePool backendRefs enabled in its config)."""
    return [
        {
            "apiVersion": "gateway.networking.k8s.io/v1",
            "kind": "GatewayClass",
            "metadata": {"name": "envoy-gateway"},
            "spec": {"controllerName": "gateway.envoyproxy.io/gatewayclass-controller"},
        },
        _gateway(p, "inference-gateway", "envoy-gateway"),
        _route(p, "inference-gateway"),
    ]


def istio(p: DeployParams) -> list[dict[str, Any]]:
    """Istio (1.27+, installed with ENABLE_GATEWAY_API_INFERENCE_EXTENSION=true), and a
    DestinationRule for the gateway's connection to the EPP Service. The EPP serves TLS in
    Kubernetes mode (`--secure-serving`, a self-signed certificate unless `--cert-path`), as
    upstream's does, so the rule says `SIMPLE` with `insecureSkipVerify`, as upstream's chart
    (no mesh mTLS: the Gateway speaks ext_proc to the EPP directly)."""
    rule = {
        "apiVersion": "networking.istio.io/v1",
        "kind": "DestinationRule",
        "metadata": meta(p.epp, p),
        "spec": {
            "host": f"{p.epp}.{p.namespace}.svc.cluster.local",
            "trafficPolicy": {"tls": {"mode": "SIMPLE", "insecureSkipVerify": True}},
        },
    }
    return [_gateway(p, "inference-gateway", "istio"), _route(p, "inference-gateway"), rule]


def kgateway(p: DeployParams) -> list[dict[str, Any]]:
    """kgateway (v2.1+, installed with `inferenceExtension.enabled=true`; its Helm chart
    creates the `kgateway` GatewayClass)."""
    return [_gateway(p, "inference-gateway", "kgateway"), _route(p, "inference-gateway")]


def nginx_gateway_fabric(p: DeployParams) -> list[dict[str, Any]]:
    """NGINX Gateway Fabric (v2.2+, installed with
    `nginxGateway.gwAPIInferenceExtension.enable=true`; its chart creates the `nginx` class)."""
    return [_gateway(p, "inference-gateway", "nginx"), _route(p, "inference-gateway")]


def gke(p: DeployParams) -> list[dict[str, Any]]:
    """GKE's managed Gateway (regional external Application Load Balancer, the class upstream's
    guide uses), with the load balancer's health check of the pool's model servers and a
    backend timeout long enough for a generation (upstream's chart sets both as well)."""
    target = {"group": ip.V1_GROUP, "kind": "InferencePool", "name": p.pool}
    return [
        _gateway(p, "inference-gateway", "gke-l7-regional-external-managed"),
        _route(p, "inference-gateway"),
        {
            "apiVersion": "networking.gke.io/v1",
            "kind": "HealthCheckPolicy",
            "metadata": meta(p.pool, p),
            "spec": {
                "targetRef": target,
                "default": {
                    "config": {
                        "type": "HTTP",
                        "httpHealthCheck": {"requestPath": "/health", "port": MODEL_PORT},
                    }
                },
            },
        },
        {
            "apiVersion": "networking.gke.io/v1",
            "kind": "GCPBackendPolicy",
            "metadata": meta(p.pool, p),
            "spec": {
                "targetRef": target,
                "default": {"timeoutSec": 300, "logging": {"enabled": True}},
            },
        },
    ]


# --gateway NAME and deploy/gateway/NAME.yaml: one entry per provider.
PROVIDERS = {
    "envoy-gateway": envoy_gateway,
    "istio": istio,
    "kgateway": kgateway,
    "gke": gke,
    "nginx-gateway-fabric": nginx_gateway_fabric,
}
