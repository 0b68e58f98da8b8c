"""`--fairness-id-metric-label-limit`, honoured as upstream: a stream of requests with distinct
fairness ids through the EPP's ext_proc port; /metrics keeps the first `limit` ids and reports
the rest as `other`, on the request families and the flow-control ones alike. Real parts: the
runtime with the EPP's serve options (from the flags), a simulated model server, loopback."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import aiohttp
import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from poolkeeper.cli.epp import epp_serve_options
from poolkeeper.cli.epp_flags import parse_epp_args
from poolkeeper.controller.files import file_source
from poolkeeper.netutil import free_ports
from poolkeeper.server.runtime import GatewayRuntime
from poolkeeper.sim.config import ServerSettings, build_fleet
from poolkeeper.sim.server import SimCluster
from tests.extproc.extproc_fakes import FakeEnvoy
from tests.extproc.test_extproc_protocol import _streamed_request

pytestmark = pytest.mark.integration

MODEL = "m"


def _config(tmp_path: Path, sim_port: int) -> tuple[Path, int, int]:
    """A pool of one simulated server, flow control on, the fairness header read."""
    ext_proc, metrics, health = free_ports(3)
    path = tmp_path / "gw.yaml"
    path.write_text(
        f"""\
apiVersion: poolkeeper.dev/v1alpha1
kind: GatewayConfig
metadata: {{name: default}}
spec:
  listeners: {{address: 127.0.0.1, extProc: {ext_proc}, metrics: {metrics}, health: {health}}}
  endpoints:
    - {{name: sim-0, address: 127.0.0.1, port: {sim_port}, labels: {{app: sim}}}}
  requestHandling: {{trustedHeaders: [x-llm-d-inference-fairness-id]}}
---
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferencePool
metadata: {{name: pool, namespace: default}}
spec:
  selector: {{app: sim}}
  targetPortNumber: 8000
  extensionRef: {{name: epp}}
---
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceModel
metadata: {{name: m, namespace: default}}
spec: {{modelName: {MODEL}, poolRef: {{name: pool}}}}
"""
    )
    return path, ext_proc, metrics


def _fairness_ids(text: str, family: str) -> set[str]:
    for parsed in text_string_to_metric_families(text):
        if parsed.name == family:
            return {s.labels["fairness_id"] for s in parsed.samples}
    raise AssertionError(f"{family} is not exported")


async def test_fairness_ids_past_the_limit_are_reported_as_other(tmp_path: Path) -> None:
    cluster = SimCluster(build_fleet(count=1, cli=ServerSettings(model=MODEL, step_jitter=0.0)))
    (sim,) = await cluster.start()
    path, ext_proc, metrics = _config(tmp_path, sim.port)
    options = parse_epp_args(
        ["--pool-name=pool", "--fairness-id-metric-label-limit=2",
         "--metrics-endpoint-auth=false", "--secure-serving=false"]
    )  # fmt: skip
    serve = epp_serve_options(options, file_source([path]))
    assert serve.fairness_id_label_limit == 2
    runtime = GatewayRuntime(dataclasses.replace(serve, ready_once_synced=False, ready_wait_s=5))
    await runtime.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{ext_proc}")
    try:
        body = json.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        ).encode()
        for i in range(5):
            headers = {"x-request-id": f"req-{i}", "x-llm-d-inference-fairness-id": f"team-{i}"}
            call, replies = await _streamed_request(
                FakeEnvoy(channel), body, piece=len(body), headers=headers
            )
            call.cancel()
            assert replies[0].WhichOneof("response") == "request_headers", replies[0]
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{metrics}/metrics") as response,
        ):
            text = await response.text()
        for family in (
            "llm_d_epp_request",
            "llm_d_epp_flow_control_request_queue_duration_seconds",
            "inference_extension_flow_control_request_queue_duration_seconds",
        ):
            assert _fairness_ids(text, family) == {"team-0", "team-1", "other"}, family
    finally:
        await channel.close()
        await runtime.stop(grace_s=0)
        await cluster.stop()
        await asyncio.sleep(0)
