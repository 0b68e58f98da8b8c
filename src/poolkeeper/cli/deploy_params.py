"""What every generated Kubernetes object shares (pure): the parameters of a deployment
(namespace, pool, image, model, replicas), the names and ports derived from them, and the
metadata helpers. `deploy_objects.py` (RBAC, the EPP), `deploy_sync.py` (cross-replica sync's
objects) and `deploy_examples.py` (the example pool and Gateways) build on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from poolkeeper import __version__
from poolkeeper.api.names import dns1123_label_errors
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


def labels(p: DeployParams) -> dict[str, str]:
    return {"app.kubernetes.io/name": "poolkeeper", "app.kubernetes.io/instance": p.epp}
