"""Conformance helpers (llm-d-router §5.5): `x-conformance-test-served-endpoint` on responses
when enabled (off by default), and an EndpointPickerConfig naming
`destination-endpoint-served-verifier` turns it on."""

from __future__ import annotations

import asyncio

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from poolkeeper.config.endpointpicker import load_endpoint_picker_config, translate
from poolkeeper.config.gateway import GatewayConfig
from poolkeeper.extproc.contracts import ExtProcSettings
from poolkeeper.extproc.state import Exchange
from tests.extproc.extproc_fakes import TRANSPORTS, FakeRouter, headers_msg
from tests.extproc.test_extproc_protocol import CHAT, _serving, _set_headers, _streamed_request

SERVED = "x-conformance-test-served-endpoint"


def _response_headers(served: str | None) -> pb.ProcessingRequest:
    request = headers_msg({":status": "200", "content-type": "application/json"}, response=True)
    if served is not None:
        lb = struct_pb2.Struct()
        lb.update({"x-gateway-destination-endpoint-served": served})
        request.metadata_context.filter_metadata["envoy.lb"].CopyFrom(lb)
    return request


async def _served_header(enabled: bool, served: str | None, transport: str) -> str | None:
    ended: list[Exchange] = []
    settings = ExtProcSettings(conformance_served_header=enabled)
    async with _serving(FakeRouter(), ended, settings, transport) as envoy:
        call, _ = await _streamed_request(envoy, CHAT, piece=len(CHAT))
        await call.write(_response_headers(served))
        reply = await asyncio.wait_for(call.read(), 5)
        call.cancel()
    headers = _set_headers(reply.response_headers.response.header_mutation)
    return headers.get(SERVED)


@pytest.mark.parametrize(
    ("enabled", "served", "expected"),
    [
        (True, "10.0.0.2:8000", "10.0.0.2:8000"),
        (True, None, "fail: missing destination endpoint served metadata"),
        (False, "10.0.0.2:8000", None),
    ],
)
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_served_endpoint_header(
    enabled: bool, served: str | None, expected: str, transport: str
) -> None:
    assert await _served_header(enabled, served, transport) == expected


def test_the_verifier_plugin_turns_it_on_and_it_is_off_by_default() -> None:
    assert GatewayConfig.default().spec.request_handling.conformance_served_endpoint_header is False
    text = (
        "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n"
        "- type: header-based-testing-filter\n- type: destination-endpoint-served-verifier\n"
    )
    translation = translate(load_endpoint_picker_config(text, "t"))
    config = GatewayConfig.model_validate({"spec": dict(translation.sections)})
    assert config.spec.request_handling.conformance_served_endpoint_header is True
    (profile,) = config.spec.scheduling.scheduling_profiles
    assert [p.plugin_ref for p in profile.plugins] == [
        "header-based-testing-filter",
        "max-score-picker",
    ]
