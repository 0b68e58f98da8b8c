"""The ext_proc layer alone: its requests per server CPU-second, with a trivial router.

The same message pattern Envoy sends for one request (request headers + body, response headers,
two response body chunks) from a gRPC client to the ext_proc server in a child process whose
router always answers the same endpoint: the protocol's share of the EPP's cost
(`protocol_only`, the "ext_proc layer alone" line of `gateway_overhead`).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from poolkeeper.bench.overhead.overhead_gateway import BODY, cpu_seconds


class _TrivialRouter:
    """Always the same endpoint; no parsing: isolates the ext_proc layer's own cost."""

    async def route(self, request: Any) -> Any:
        from poolkeeper.requestcontrol.types import RoutingDecision

        return RoutingDecision(request.request_id, ("127.0.0.1:1",), "default/p", "m", "m")

    def complete(
        self, decision: Any, *, status: int, usage: Any, served_endpoint: Any = None
    ) -> None:
        pass

    def served(self, decision: Any, endpoint: str) -> None:
        pass

    def first_byte(self, decision: Any, *, after_s: float | None = None) -> None:
        pass

    def model_names(self) -> list[str]:
        return ["m"]

    def ready(self) -> bool:
        return True


def _protocol_server(port_queue: Any) -> None:
    from poolkeeper.extproc.server import ExtProcServicer, build_server

    async def run() -> None:
        server, port = build_server(ExtProcServicer(_TrivialRouter()), "127.0.0.1:0")
        await server.start()
        port_queue.put(port)
        await asyncio.sleep(3600)

    asyncio.run(run())


async def _protocol_client(port: int, n: int, concurrency: int) -> None:
    import grpc
    from envoy.config.core.v3 import base_pb2
    from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
    from envoy.service.ext_proc.v3 import (
        external_processor_pb2 as pb,
        external_processor_pb2_grpc as pb_grpc,
    )

    def headers(values: dict[str, str], *, response: bool = False) -> Any:
        hs = pb.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[
                    base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()
                ]
            )
        )
        if response:
            return pb.ProcessingRequest(response_headers=hs)
        req = pb.ProcessingRequest(request_headers=hs)
        req.protocol_config.request_body_mode = pm.ProcessingMode.FULL_DUPLEX_STREAMED
        req.protocol_config.response_body_mode = pm.ProcessingMode.FULL_DUPLEX_STREAMED
        return req

    def body(data: bytes, eos: bool, *, response: bool = False) -> Any:
        b = pb.HttpBody(body=data, end_of_stream=eos)
        return (
            pb.ProcessingRequest(response_body=b)
            if response
            else pb.ProcessingRequest(request_body=b)
        )

    request_headers = headers({":method": "POST", ":path": "/v1/chat/completions"})
    request_body = body(json.dumps(BODY).encode(), True)
    response_headers = headers(
        {":status": "200", "content-type": "application/json"}, response=True
    )
    usage = json.dumps({"usage": {"prompt_tokens": 1, "completion_tokens": 1}}).encode()
    semaphore = asyncio.Semaphore(concurrency)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)

        async def one() -> None:
            async with semaphore:
                call = stub.Process()
                await call.write(request_headers)
                await call.write(request_body)
                await call.read()
                await call.read()
                await call.write(response_headers)
                await call.read()
                await call.write(body(usage, False, response=True))
                await call.read()
                await call.write(body(b"", True, response=True))
                await call.read()
                await call.done_writing()
                await call.read()

        await asyncio.gather(*(one() for _ in range(n)))


def protocol_only(n: int = 3000, concurrency: int = 16) -> float:
    """Requests per CPU-second of an ext_proc server with a trivial router."""
    import multiprocessing

    queue: Any = multiprocessing.Queue()
    child = multiprocessing.Process(target=_protocol_server, args=(queue,), daemon=True)
    child.start()
    try:
        port = queue.get(timeout=30)
        asyncio.run(_protocol_client(port, 300, concurrency))  # warm-up
        assert child.pid is not None
        cpu0 = cpu_seconds(child.pid)
        asyncio.run(_protocol_client(port, n, concurrency))
        return n / (cpu_seconds(child.pid) - cpu0)
    finally:
        child.kill()
        child.join(5)
