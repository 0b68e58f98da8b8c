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

from poolkeeper.cli.epp_flags import parse_epp_args
from poolkeeper.cli.epp_setup import epp_serve_options
from poolkeeper.controller.files import file_source
from tests.extproc.extproc_fakes import FakeEnvoy
from tests.extproc.test_extproc_protocol import _streamed_request
from tests.support.gateway_files import gateway_ports, one_pool
from tests.support.sim_gateway import MODEL, running_gateway, sim_server

pytestmark = pytest.mark.integration

FAIRNESS = "  requestHandling: {trustedHeaders: [x-llm-d-inference-fairness-id]}\n"


def _fairness_ids(text: str, family: str) -> set[str]:
    for parsed in text_string_to_metric_families(text):
        if parsed.name == family:
            return {s.labels["fairness_id"] for s in parsed.samples}
    raise AssertionError(f"{family} is not exported")


async def test_fairness_ids_past_the_limit_are_reported_as_other(tmp_path: Path) -> None:
    options = parse_epp_args(
        ["--pool-name=pool", "--fairness-id-metric-label-limit=2",
         "--metrics-endpoint-auth=false", "--secure-serving=false"]
    )  # fmt: skip
    ports = gateway_ports()
    ext_proc, metrics = ports["ext_proc"], ports["metrics"]
    async with sim_server() as sim_port:
        # A pool of one simulated server, flow control on, the fairness header read.
        directory = one_pool(tmp_path, sim_port, address="127.0.0.1", spec=FAIRNESS, ports=ports)
        serve = epp_serve_options(options, file_source([directory]))
        assert serve.fairness_id_label_limit == 2
        assert not serve.own_bootstrap  # behind any Gateway: the EPP sets no header limits
        async with (
            running_gateway(dataclasses.replace(serve, ready_once_synced=False, ready_wait_s=5)),
            grpc.aio.insecure_channel(f"127.0.0.1:{ext_proc}") as channel,
        ):
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
    await asyncio.sleep(0)
    for family in (
        "llm_d_epp_request",
        "llm_d_epp_flow_control_request_queue_duration_seconds",
        "inference_extension_flow_control_request_queue_duration_seconds",
    ):
        assert _fairness_ids(text, family) == {"team-0", "team-1", "other"}, family
