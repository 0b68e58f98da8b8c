"""The gateway's configuration files, as tests write them: a GatewayConfig over given
endpoints, InferencePool and InferenceModel documents, free listener ports, and the
one-pool, one-server directory most single-server gateway tests serve from."""

from __future__ import annotations

import json
from pathlib import Path

from poolkeeper.netutil import free_ports

POOL = """\
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferencePool
metadata: {{name: {name}, namespace: default}}
spec:
  selector: {{app: {app}}}
  targetPortNumber: 8000
  extensionRef: {{name: {name}-epp, failureMode: {failure_mode}}}
"""

MODEL = """\
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceModel
metadata: {{name: {object_name}, namespace: default}}
spec:
  modelName: {model}
{criticality}  poolRef: {{name: {pool}}}
{targets}"""


def model_doc(
    model: str,
    pool: str,
    criticality: str | None,
    targets: dict[str, int] | list[str] | None = None,
) -> str:
    """An InferenceModel of `pool`; `criticality` None leaves it unset (Standard)."""
    lines = ""
    if isinstance(targets, dict):
        lines = "  targetModels:\n" + "".join(
            f"    - {{name: {t}, weight: {w}}}\n" for t, w in targets.items()
        )
    elif targets:
        lines = "  targetModels:\n" + "".join(f"    - {{name: {t}}}\n" for t in targets)
    object_name = model.lower().replace("/", "-").replace(".", "-").replace("_", "-")
    return MODEL.format(
        object_name=object_name,
        model=model,
        criticality=f"  criticality: {criticality}\n" if criticality else "",
        pool=pool,
        targets=lines,
    )


def gateway_doc(
    ports: dict[str, int],
    endpoints: list[tuple[str, int, str]],
    transport: str | None = None,
    *,
    address: str | None = None,
    host: str = "127.0.0.1",
    engine: str | None = None,
    scraping: str = "{intervalMs: 50, timeoutMs: 1000}",
) -> str:
    """A GatewayConfig listening on `ports` (`gateway_ports()`) over `endpoints` (name, port,
    app label) on `host`, of `engine` (the default, vllm, where None), scraped as `scraping`
    says; `transport` (the ext_proc port's) and `address` (the listeners' bind address) are
    the gateway's defaults where None. Its last key is `endpoints`: more spec keys may follow,
    indented two spaces."""
    bind = f"address: {address}, " if address else ""
    served_by = f", extProcTransport: {transport}" if transport else ""
    of = f", engine: {engine}" if engine else ""
    eps = "".join(
        f"    - {{name: {name}, address: {json.dumps(host)}, port: {port}, "
        f"labels: {{app: {app}}}{of}}}\n"
        for name, port, app in endpoints
    )
    return f"""\
apiVersion: poolkeeper.dev/v1alpha1
kind: GatewayConfig
metadata: {{name: default}}
spec:
  listeners: {{{bind}http: {ports["http"]}, extProc: {ports["ext_proc"]},
    metrics: {ports["metrics"]}, health: {ports["health"]}, admin: {ports["admin"]}{served_by}}}
  scraping: {scraping}
  endpoints:
{eps}"""


def write_config(directory: Path, docs: list[str]) -> Path:
    """The documents as one `gateway.yaml` in `directory` (created); the directory."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "gateway.yaml").write_text("---\n".join(docs))
    return directory


def one_server_config(
    directory: Path, ports: dict[str, int], sim_port: int, model: str = "tiny-base"
) -> Path:
    """A gateway over one simulator at `sim_port`: pool "tiny" (FailClose) serving `model`
    (Critical); the documents written to `directory`."""
    docs = [
        gateway_doc(ports, [("tiny-0", sim_port, "tiny")]),
        POOL.format(name="tiny", app="tiny", failure_mode="FailClose"),
        model_doc(model, "tiny", "Critical"),
    ]
    return write_config(directory, docs)


def one_pool(
    directory: Path,
    sim_port: int,
    *,
    model: str = "m",
    spec: str = "",
    transport: str | None = None,
    address: str | None = None,
    failure_mode: str = "FailClose",
    host: str = "127.0.0.1",
    ports: dict[str, int] | None = None,
) -> Path:
    """A gateway on free ports (or `ports`) over one server `sim-0` at `host:sim_port`:
    pool "pool" (`failure_mode`) serving `model` (criticality unset); `spec`: more GatewayConfig
    spec keys (YAML lines indented two spaces). Written to `directory`, which is returned."""
    docs = [
        gateway_doc(
            ports or gateway_ports(),
            [("sim-0", sim_port, "sim")],
            transport,
            address=address,
            host=host,
        )
        + spec,
        POOL.format(name="pool", app="sim", failure_mode=failure_mode),
        model_doc(model, "pool", None),
    ]
    return write_config(directory, docs)


def gateway_ports() -> dict[str, int]:
    """Free ports for the gateway's five listeners."""
    http, ext_proc, metrics, health, admin = free_ports(5)
    return {"http": http, "ext_proc": ext_proc, "metrics": metrics, "health": health,
            "admin": admin}  # fmt: skip
