"""The chart's rendered arguments, run through `poolkeeper epp` against the API-server double:
a v1 InferencePool with no objectives, one simulated pod. It becomes ready, routes any model
to one endpoint, and writes nothing but its Lease (the chart's RBAC is read-only otherwise)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from poolkeeper.cli import epp_setup
from poolkeeper.cli.epp_flags import parse_epp_args
from poolkeeper.cli.epp_options import EppOptions
from poolkeeper.config.endpointpicker import DEFAULT_CONFIG_TEXT
from poolkeeper.config.gateway import GatewayConfig
from poolkeeper.controller.source import SourceFactory
from poolkeeper.netutil import free_ports
from poolkeeper.server.options import ServeOptions
from poolkeeper.server.runtime import GatewayRuntime
from poolkeeper.sim.cluster import SimCluster
from poolkeeper.sim.config import ServerSettings, build_fleet
from poolkeeper.telemetry.health import SERVING, check_health
from tests.epp.test_epp_command import _chart_args
from tests.extproc.extproc_fakes import FakeEnvoy
from tests.extproc.test_extproc_protocol import _set_headers, _streamed_request
from tests.kube.conftest import NS, fake, pod_obj
from tests.kube.fakeapi import FakeApiServer
from tests.support.kubeconfig import write_kubeconfig
from tests.support.waiting import eventually

__all__ = ["fake"]  # the API-server double fixture

pytestmark = pytest.mark.integration


def _v1_pool(port: int) -> dict[str, Any]:
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": "qwen", "namespace": NS},
        "spec": {
            "selector": {"matchLabels": {"app": "vllm"}},
            "targetPorts": [{"number": port}],
            "endpointPickerRef": {"name": "qwen-epp", "port": {"number": 9002}},
        },
    }


@dataclass
class ChartEpp:
    """`poolkeeper epp` with the chart's arguments, running against the API-server double."""

    ext_proc: int
    health: int
    metrics: int


def loopback_kubernetes_source(options: EppOptions) -> SourceFactory:
    """`poolkeeper epp`'s Kubernetes source for `options`, its listeners bound to loopback
    (tests bind nothing else)."""
    config, _ = epp_setup.epp_gateway_config(options)
    document = config.model_dump(by_alias=True, exclude_unset=True)
    document["spec"]["listeners"]["address"] = "127.0.0.1"
    source: SourceFactory = epp_setup.epp_kubernetes_source(
        options, GatewayConfig.model_validate(document)
    )
    return source


@asynccontextmanager
async def chart_epp(
    fake: FakeApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[ChartEpp]:
    """The chart's rendered arguments (its default-plugins.yaml for vllm), the API server from
    a kubeconfig; ready (readiness SERVING) when entered. Only the bind address differs:
    tests bind loopback."""
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", fake.url, token="sa-token")
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.setenv("POD_NAME", "qwen-epp-6d4b9c7f5-x2x9k")
    ext_proc, health, metrics = free_ports(3)
    args = [a if a != "llm" else NS for a in _chart_args(tmp_path)]  # the pool's namespace
    # The chart's default-plugins.yaml for modelServers.type vllm (the simulator's engine).
    (tmp_path / "default-plugins.yaml").write_text(DEFAULT_CONFIG_TEXT)
    argv = [*args, f"--grpc-port={ext_proc}", f"--grpc-health-port={health}",
            f"--metrics-port={metrics}"]  # fmt: skip
    options = parse_epp_args(argv)
    source = loopback_kubernetes_source(options)
    runtime = GatewayRuntime(ServeOptions(source=source, run_envoy=False, ready_wait_s=5))
    await runtime.start()
    try:

        async def ready() -> bool:
            return await check_health(f"127.0.0.1:{health}", "readiness") == SERVING

        await eventually(ready, "readiness")
        yield ChartEpp(ext_proc, health, metrics)
    finally:
        await runtime.stop(grace_s=0)


async def test_the_charts_arguments_serve_a_v1_pool(
    fake: FakeApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = SimCluster(build_fleet(count=1, cli=ServerSettings()))
    sim_port = (await cluster.start())[0].port
    fake.put(_v1_pool(sim_port), "inferencepools")
    fake.put(pod_obj("sim-0", "127.0.0.1"), "pods")
    try:
        async with chart_epp(fake, tmp_path, monkeypatch) as epp:
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{epp.ext_proc}")
            try:
                body = json.dumps(
                    {
                        "model": "Qwen/any-name-at-all",
                        "messages": [{"role": "user", "content": "hi"}],
                    }
                ).encode()
                call, replies = await _streamed_request(FakeEnvoy(channel), body, piece=len(body))
                call.cancel()
                assert replies[0].WhichOneof("response") == "request_headers", replies[0]
                first = replies[0].request_headers.response
                destination = _set_headers(first.header_mutation)["x-gateway-destination-endpoint"]
                assert destination == f"127.0.0.1:{sim_port}"  # one endpoint, no fallbacks
                # Read-only but for the Lease of --ha-enable-leader-election (replicas 2), as
                # the chart's RBAC allows.
                assert {w.plural for w in fake.writes} <= {"leases"}
            finally:
                await channel.close()
    finally:
        await cluster.stop()
        await asyncio.sleep(0)
