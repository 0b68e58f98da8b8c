"""Kubernetes mode: pools, models and Pods from the API server; status written back.

    objects.py   pure core: API dicts → pools, models, endpoint specs; per-kind caches
    client.py    KubeApi: list / watch / get / patch status / Lease writes (lightkube)
    state.py     ClusterState: the caches and their datastore view (pools, models, endpoints)
    source.py    KubernetesResourceSource: list, then watch; re-list and prune on failure
    status.py    StatusWriter: Accepted conditions, only when changed, 409-safe
    leader.py    LeaderElector: one status writer at a time (coordination.k8s.io Lease)
    backoff.py   exponential backoff with jitter

`kubernetes_source(...)` is the `SourceFactory` that `poolkeeper serve --kubernetes` passes to
the runtime.
"""

from __future__ import annotations

from lightkube.config.kubeconfig import SingleConfig

from poolkeeper.config.gateway import GatewayConfig
from poolkeeper.controller.kubernetes.client import KubeApi, load_config
from poolkeeper.controller.kubernetes.source import KubernetesResourceSource
from poolkeeper.controller.kubernetes.source_state import KubeSettings
from poolkeeper.controller.source import SourceFactory
from poolkeeper.datastore.store import Datastore

__all__ = [
    "KubeApi",
    "KubeSettings",
    "KubernetesResourceSource",
    "kubernetes_source",
    "load_config",
]


def kubernetes_source(
    settings: KubeSettings, gateway_config: GatewayConfig | None, config: SingleConfig
) -> SourceFactory:
    """The factory `ServeOptions.source` takes (`config` from `load_config`, which raises
    ConfigError for a bad kubeconfig before anything starts)."""

    def factory(datastore: Datastore) -> KubernetesResourceSource:
        api = KubeApi(config, settings.namespace)
        return KubernetesResourceSource(api, datastore, settings, gateway_config)

    return factory
