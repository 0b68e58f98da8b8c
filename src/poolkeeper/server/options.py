"""`ServeOptions`: how the commands (`serve`, `quickstart`, `poolkeeper-epp`) ask the runtime
to run, beside what the resource source yields (`server/runtime.py` reads both): whether it
runs Envoy and where, the drain's grace and timeout, readiness rules, TLS and the metrics
server's middlewares. Plain values: the commands' flags fill them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from poolkeeper.controller.source import SourceFactory
from poolkeeper.extproc.tls import TlsSettings

DEFAULT_DRAIN_GRACE_S = 130.0  # upstream chart's terminationGracePeriodSeconds (vLLM's)
DEFAULT_DRAIN_TIMEOUT_S = 30.0  # upstream EPP's --drain-timeout (Kubernetes mode)


@dataclass(slots=True)
class ServeOptions:
    source: SourceFactory  # where pools, models, endpoints and the GatewayConfig come from
    run_envoy: bool = True
    envoy_path: str | None = None
    workdir: Path | None = None  # bootstrap + Envoy log; a temporary directory when None
    envoy_concurrency: int = 1
    drain_grace_s: float = DEFAULT_DRAIN_GRACE_S
    rng_seed: int | None = None
    ready_wait_s: float = 3.0  # at start, wait this long at most for a fresh endpoint
    # Readiness as upstream's EPP (Kubernetes mode): ready once the source has synced, and
    # then through API trouble and an empty pool (the EPP answers 503 itself). Otherwise
    # readiness also needs an endpoint with fresh metrics.
    ready_once_synced: bool = False
    # After SIGTERM, ext_proc keeps taking new streams this long (readiness already
    # NOT_SERVING, the source stopped, so a Kubernetes Lease is released at once): the
    # cluster's Gateway keeps sending until it sees this replica go (upstream --drain-timeout).
    drain_timeout_s: float = 0.0
    # TLS on the ext_proc port (upstream's --secure-serving; Kubernetes mode turns it on).
    tls: TlsSettings = field(default_factory=TlsSettings)
    # aiohttp middlewares of the metrics server (upstream's --metrics-endpoint-auth).
    metrics_middlewares: tuple[Any, ...] = ()
    # gRPC health as llm-d-router's EPP answers it (leader-aware; `poolkeeper-epp`).
    upstream_health: bool = False
    # The EPP sits behind poolkeeper's own Envoy bootstrap (`serve`, `envoy-config`), whose
    # listener leaves room above the client's header limits for the EPP to enforce them (431);
    # False for `poolkeeper-epp` behind any Gateway, whose own headers would count.
    own_bootstrap: bool = True
    # Distinct `fairness_id` metric label values, then `other` (--fairness-id-metric-label-limit).
    fairness_id_label_limit: int = 1000
