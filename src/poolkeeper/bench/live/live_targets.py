"""The routers a live benchmark run measures, and how each is started in front of the simulators.

`POOLKEEPER` (`poolkeeper serve` with a generated GatewayConfig: `poolkeeper_config`) and the
peers (`KNOWN_PEERS`: vllm-router, `vllm-router-rr` its round-robin policy, and sglang-router
as `scripts/install-peers.sh` installs them; `envoy-rr` the same Envoy with a static
round-robin cluster, `envoy_rr_bootstrap`);
`router_command` gives a target's command line, HTTP port and readiness URL, `models_of` the
InferenceModels a workload asks for.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from poolkeeper.bench.workload.workload_spec import (
    CRITICALITY_MODELS,
    FAIRNESS_MODELS,
    WorkloadKind,
)
from poolkeeper.errors import ConfigError
from poolkeeper.netutil import free_ports

POOLKEEPER = "poolkeeper"
KNOWN_PEERS = ("vllm-router", "sglang-router", "envoy-rr", "vllm-router-rr")


def peer_binary(peer: str, root: Path) -> list[str] | None:
    """The command prefix that starts a peer, or None if it is not installed."""
    if peer in ("vllm-router", "vllm-router-rr"):
        exe = root / ".peers" / "venv-vllm-router" / "bin" / "vllm-router"
        return [str(exe)] if exe.is_file() else None
    if peer == "sglang-router":
        py = root / ".peers" / "venv-sglang-router" / "bin" / "python"
        return [str(py), "-m", "sglang_router.launch_router"] if py.is_file() else None
    if peer == "envoy-rr":
        envoy = envoy_binary()
        return [envoy] if envoy else None
    return None


def envoy_binary() -> str | None:
    exe = Path(sys.executable).parent / "envoy"
    return str(exe) if exe.is_file() else None


def models_of(kind: WorkloadKind, spec_adapters: tuple[str, ...]) -> list[tuple[str, str, str]]:
    """(modelName, criticality, target) for every model the workload asks for."""
    if kind is WorkloadKind.MULTI_LORA:
        return [(a, "Standard", a) for a in spec_adapters]
    if kind in (WorkloadKind.MIXED_CRITICALITY, WorkloadKind.CRITICALITY_FLOOD):
        return [(m, str(c), "base-model") for c, m in CRITICALITY_MODELS.items()]
    if kind is WorkloadKind.FAIRNESS:
        return [(m, "Standard", "base-model") for m in FAIRNESS_MODELS]
    return [("base-model", "Standard", "base-model")]


def poolkeeper_config(
    work: Path,
    sim_ports: Sequence[int],
    ports: dict[str, int],
    models: list[tuple[str, str, str]],
    scheduling: dict[str, Any] | None = None,
    flow_control: dict[str, Any] | None = None,
) -> Path:
    cfg = work / "poolkeeper"
    cfg.mkdir(parents=True, exist_ok=True)
    endpoints = "\n".join(
        f"    - {{name: sim-{i}, address: 127.0.0.1, port: {p}, labels: {{app: bench-sim}}}}"
        for i, p in enumerate(sim_ports)
    )
    (cfg / "gateway.yaml").write_text(
        "apiVersion: poolkeeper.dev/v1alpha1\nkind: GatewayConfig\nmetadata: {name: default}\n"
        "spec:\n"
        f"  listeners: {{address: 127.0.0.1, http: {ports['http']}, extProc: {ports['extproc']}, "
        f"metrics: {ports['metrics']}, health: {ports['health']}, admin: {ports['admin']}}}\n"
        f"  endpoints:\n{endpoints}\n"
        "  scraping: {intervalMs: 50}\n"
        + (f"  scheduling: {json.dumps(scheduling)}\n" if scheduling is not None else "")
        + (f"  flowControl: {json.dumps(flow_control)}\n" if flow_control is not None else "")
    )
    docs = [
        "apiVersion: inference.networking.x-k8s.io/v1alpha2\nkind: InferencePool\n"
        "metadata: {name: bench, namespace: default}\n"
        "spec:\n  selector: {app: bench-sim}\n  targetPortNumber: 8000\n"
        "  extensionRef: {name: bench-epp}\n"
    ]
    for i, (name, crit, target) in enumerate(models):
        targets = "" if target == name else f"  targetModels:\n    - {{name: {target}}}\n"
        docs.append(
            "apiVersion: inference.networking.x-k8s.io/v1alpha2\nkind: InferenceModel\n"
            f"metadata: {{name: model-{i}, namespace: default}}\n"
            f"spec:\n  modelName: {name}\n  criticality: {crit}\n{targets}"
            "  poolRef: {name: bench}\n"
        )
    (cfg / "models.yaml").write_text("---\n".join(docs))
    return cfg


_HCM = (
    "type.googleapis.com/"
    "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
)


def envoy_rr_bootstrap(path: Path, port: int, admin_port: int, sim_ports: Sequence[int]) -> None:
    endpoints = "\n".join(
        "        - endpoint: {address: {socket_address: "
        f"{{address: 127.0.0.1, port_value: {p}}}}}}}"
        for p in sim_ports
    )
    path.write_text(
        f"""admin:
  address: {{socket_address: {{address: 127.0.0.1, port_value: {admin_port}}}}}
static_resources:
  listeners:
  - name: rr
    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": {_HCM}
          stat_prefix: rr
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route: {{cluster: sims, timeout: 0s}}
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: sims
    type: STATIC
    lb_policy: ROUND_ROBIN
    connect_timeout: 1s
    circuit_breakers:
      thresholds: [{{max_connections: 100000, max_pending_requests: 100000, max_requests: 100000}}]
    load_assignment:
      cluster_name: sims
      endpoints:
      - lb_endpoints:
{endpoints}
"""
    )


def router_command(
    target: str,
    root: Path,
    work: Path,
    sim_ports: Sequence[int],
    models: list[tuple[str, str, str]],
    scheduling: dict[str, Any] | None = None,
    flow_control: dict[str, Any] | None = None,
) -> tuple[list[str], int, str]:
    """(command, HTTP port, readiness URL) of one target."""
    workers = [f"http://127.0.0.1:{p}" for p in sim_ports]
    if target == POOLKEEPER:
        names = ("http", "extproc", "metrics", "health", "admin")
        ports = dict(zip(names, free_ports(len(names)), strict=True))
        cfg = poolkeeper_config(work, sim_ports, ports, models, scheduling, flow_control)
        cmd = [sys.executable, "-m", "poolkeeper", "serve", "-f", str(cfg),
               "--workdir", str(work / "serve"), "--log-level", "warning"]  # fmt: skip
        return cmd, ports["http"], f"http://127.0.0.1:{ports['http']}/v1/models"
    prefix = peer_binary(target, root)
    if prefix is None:
        raise ConfigError(f"{target} is not installed (run scripts/install-peers.sh)")
    port, prom = free_ports(2)
    if target in ("vllm-router", "vllm-router-rr"):
        policy = "round_robin" if target == "vllm-router-rr" else "cache_aware"
        cmd = [*prefix, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
               "--policy", policy, "--prometheus-host", "127.0.0.1",
               "--prometheus-port", str(prom)]  # fmt: skip
        return cmd, port, f"http://127.0.0.1:{port}/health"
    if target == "sglang-router":
        cmd = [*prefix, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
               "--policy", "cache_aware", "--prometheus-host", "127.0.0.1",
               "--prometheus-port", str(prom)]  # fmt: skip
        return cmd, port, f"http://127.0.0.1:{port}/health"
    bootstrap = work / "envoy-rr.yaml"
    envoy_rr_bootstrap(bootstrap, port, prom, sim_ports)
    cmd = [*prefix, "-c", str(bootstrap), "--concurrency", "1", "--log-level", "warn",
           "--disable-hot-restart"]  # fmt: skip
    return cmd, port, f"http://127.0.0.1:{port}/health"
