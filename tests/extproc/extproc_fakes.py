"""A fake Director and a gRPC client that talks to the ext_proc server the way Envoy does."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import (
    external_processor_pb2 as pb,
    external_processor_pb2_grpc as pb_grpc,
)
from google.protobuf import struct_pb2

from poolkeeper.errors import BadRequest, ModelNotFound, NoReadyEndpoint, RequestShed
from poolkeeper.extproc.accesslog import AccessLogReceiver, DetachedExchanges, FirstByteReceiver
from poolkeeper.extproc.lean import start_lean
from poolkeeper.extproc.server import ExtProcServicer, build_server
from poolkeeper.requestcontrol.types import IncomingRequest, RoutingDecision, Usage

PODS = ("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000")


@dataclass
class FakeRouter:
    """Routes `base`/`split` models over PODS; records every call for the tests to inspect."""

    pods: tuple[str, ...] = PODS
    routed: list[IncomingRequest] = field(default_factory=list)
    completed: list[tuple[RoutingDecision, int, Usage | None, str | None]] = field(
        default_factory=list
    )
    cancelled: int = 0
    moved: list[tuple[str, str]] = field(default_factory=list)
    first_bytes: list[str] = field(default_factory=list)
    first_byte_after: list[float | None] = field(default_factory=list)  # the observer's timing
    slow: asyncio.Event = field(default_factory=asyncio.Event)

    async def route(self, request: IncomingRequest) -> RoutingDecision:
        self.routed.append(request)
        pods = self.pods
        if request.subset_hint is not None:
            pods = tuple(p for p in pods if p in request.subset_hint)
        if not request.body:
            if not pods:
                raise NoReadyEndpoint("no ready endpoint")
            return RoutingDecision(request.request_id, (pods[0],), "default/pool")
        try:
            obj = json.loads(request.body)
        except ValueError as exc:
            raise BadRequest("request body is not valid JSON") from exc
        model = obj.get("model") if isinstance(obj, dict) else None
        if not isinstance(model, str):
            raise BadRequest("missing model")
        if model == "slow":
            try:
                await self.slow.wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        if model == "shed":
            raise RequestShed("pool saturated")
        if model == "boom":  # a bug in the router: anything but a GatewayError
            raise RuntimeError("router bug with a secret detail")
        if model == "nowhere":
            return RoutingDecision(request.request_id, (), "default/pool", model_name=model)
        if model not in ("base", "split", "slow"):
            raise ModelNotFound(f"model {model!r} not found")
        if not pods:
            raise NoReadyEndpoint("no ready endpoint")
        injected = False
        body: bytes | None = None
        if model == "split":
            obj["model"] = "adapter-1"
            body = json.dumps(obj).encode()
        if obj.get("stream") and not (obj.get("stream_options") or {}).get("include_usage"):
            obj["stream_options"] = {"include_usage": True}
            body = json.dumps(obj).encode()
            injected = True
        return RoutingDecision(
            request.request_id,
            pods,
            "default/pool",
            model_name=model,
            target_model=obj["model"],
            stream=bool(obj.get("stream")),
            body=body,
            include_usage_injected=injected,
        )

    def complete(
        self,
        decision: RoutingDecision,
        *,
        status: int,
        usage: Usage | None,
        served_endpoint: str | None = None,
    ) -> None:
        self.completed.append((decision, status, usage, served_endpoint))

    def served(self, decision: RoutingDecision, endpoint: str) -> None:
        self.moved.append((decision.request_id, endpoint))

    def first_byte(self, decision: RoutingDecision, *, after_s: float | None = None) -> None:
        self.first_bytes.append(decision.request_id)
        self.first_byte_after.append(after_s)

    def model_names(self) -> list[str]:
        return ["base", "split"]

    def ready(self) -> bool:
        return True


def headers_msg(
    headers: dict[str, str],
    *,
    eos: bool = False,
    mode: int | None = None,
    hint: Sequence[str] | None = None,
    response: bool = False,
) -> pb.ProcessingRequest:
    hs = pb.HttpHeaders(
        headers=base_pb2.HeaderMap(
            headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]
        ),
        end_of_stream=eos,
    )
    req = (
        pb.ProcessingRequest(response_headers=hs)
        if response
        else pb.ProcessingRequest(request_headers=hs)
    )
    if mode is not None:
        req.protocol_config.CopyFrom(
            pb.ProtocolConfiguration(request_body_mode=mode, response_body_mode=mode)
        )
    if hint is not None:
        s = struct_pb2.Struct()
        s.update({"x-gateway-destination-endpoint-subset": list(hint)})
        req.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(s)
    return req


def body_msg(data: bytes, *, eos: bool, response: bool = False) -> pb.ProcessingRequest:
    b = pb.HttpBody(body=data, end_of_stream=eos)
    return (
        pb.ProcessingRequest(response_body=b) if response else pb.ProcessingRequest(request_body=b)
    )


def post_headers(**extra: str) -> dict[str, str]:
    return {
        ":method": "POST",
        ":path": "/v1/chat/completions",
        ":authority": "gw",
        "content-type": "application/json",
        "x-request-id": "req-1",
        **extra,
    }


STREAMED = pm.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = pm.ProcessingMode.BUFFERED


class FakeEnvoy:
    """One ext_proc stream per HTTP request, written and read like Envoy does."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.stub = pb_grpc.ExternalProcessorStub(channel)

    def open(self) -> grpc.aio.StreamStreamCall:
        return self.stub.Process()


TRANSPORTS = ("grpcio", "lean")


@contextlib.asynccontextmanager
async def serving(
    transport: str,
    servicer: ExtProcServicer,
    *,
    detached: DetachedExchanges | None = None,
) -> AsyncIterator[int]:
    """`servicer` (and with `detached` the access-log and first-byte receivers) served on
    127.0.0.1 by `transport`; yields the port. Both transports must pass the same tests."""
    if transport == "lean":
        lean = await start_lean(servicer, "127.0.0.1", 0, detached=detached)
        try:
            yield lean.port
        finally:
            await lean.stop(None)
        return

    def register(server: grpc.aio.Server) -> None:
        if detached is not None:
            AccessLogReceiver(detached).register(server)
            FirstByteReceiver(detached).register(server)

    server, port = build_server(servicer, "127.0.0.1:0", extra=register)
    await server.start()
    try:
        yield port
    finally:
        await server.stop(None)
