"""The standard gRPC health service (`grpc.health.v1.Health`), without grpcio-health-checking.

The two messages are defined from a hand-built file descriptor in a private descriptor pool (so
they cannot clash with the official module if it is installed too). Services answered:
`""` and `liveness` (the process runs), `readiness` (resources loaded and at least one endpoint
with fresh metrics; in Kubernetes mode, as upstream's EPP, only the first sync; NOT_SERVING
while draining: for orchestrators), and the ext_proc service name
(the EPP can answer: resources loaded). Envoy health-checks the ext_proc service name, so only an
EPP that cannot answer at all counts as down; with stale endpoints the EPP still answers (and
says why, e.g. 503 no ready endpoint). Any other service name (upstream v0.3-v0.5 Deployments
probe `inference-extension`) gets the ext_proc answer, as upstream's health server answers every
name alike (`cmd/epp/health.go`): never NOT_FOUND.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

SERVICE_NAME = "grpc.health.v1.Health"
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
UNKNOWN, SERVING, NOT_SERVING, SERVICE_UNKNOWN = 0, 1, 2, 3


def _build_messages() -> tuple[type[Any], type[Any]]:
    fdp = descriptor_pb2.FileDescriptorProto(
        name="poolkeeper/grpc_health_v1.proto", package="grpc.health.v1", syntax="proto3"
    )
    req = fdp.message_type.add(name="HealthCheckRequest")
    req.field.add(name="service", number=1, type=9, label=1)  # string
    resp = fdp.message_type.add(name="HealthCheckResponse")
    enum = resp.enum_type.add(name="ServingStatus")
    for name, number in (
        ("UNKNOWN", UNKNOWN),
        ("SERVING", SERVING),
        ("NOT_SERVING", NOT_SERVING),
        ("SERVICE_UNKNOWN", SERVICE_UNKNOWN),
    ):
        enum.value.add(name=name, number=number)
    resp.field.add(
        name="status",
        number=1,
        type=14,  # enum
        label=1,
        type_name=".grpc.health.v1.HealthCheckResponse.ServingStatus",
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    request_cls = message_factory.GetMessageClass(
        pool.FindMessageTypeByName("grpc.health.v1.HealthCheckRequest")
    )
    response_cls = message_factory.GetMessageClass(
        pool.FindMessageTypeByName("grpc.health.v1.HealthCheckResponse")
    )
    return request_cls, response_cls


HealthCheckRequest, HealthCheckResponse = _build_messages()


class HealthService:
    """Answers Check and Watch from probe callables (evaluated on every call)."""

    def __init__(
        self,
        probes: Mapping[str, Callable[[], bool]],
        watch_interval_s: float = 1.0,
        default: Callable[[], bool] | None = None,
        *,
        unknown_status: bool = False,
    ):
        self.probes = dict(probes)
        self.watch_interval_s = watch_interval_s
        self.default = default
        # An unknown service name: SERVICE_UNKNOWN as a status (upstream's EPP) rather than a
        # NOT_FOUND error (grpc-health-checking's own server).
        self.unknown_status = unknown_status

    @classmethod
    def for_gateway(
        cls,
        *,
        live: Callable[[], bool],
        ready: Callable[[], bool],
        answering: Callable[[], bool] | None = None,
    ) -> HealthService:
        serving = answering or live
        return cls(
            {"": live, "liveness": live, "readiness": ready, EXT_PROC_SERVICE: serving},
            default=serving,
        )

    @classmethod
    def for_upstream_epp(
        cls, *, ready: Callable[[], bool], leading: Callable[[], bool | None]
    ) -> HealthService:
        """Health as llm-d-router's EPP answers it (`cmd/epp/runner/health.go`). Without
        leader election (`leading()` None) every service name gets the one readiness answer.
        With it, `liveness` is always SERVING; `readiness`, `""` and the ext_proc service are
        SERVING only on the leader; any other name is SERVICE_UNKNOWN."""

        def leader_ready() -> bool:
            return bool(leading()) and ready()

        if leading() is None:
            return cls({}, default=ready)
        gated = {name: leader_ready for name in ("", "readiness", EXT_PROC_SERVICE)}
        return cls({"liveness": lambda: True, **gated}, unknown_status=True)

    def status(self, service: str) -> int | None:
        probe = self.probes.get(service, self.default)
        if probe is None:
            return None
        try:
            return SERVING if probe() else NOT_SERVING
        except Exception:
            return NOT_SERVING

    def check_status(self, service: str) -> int | None:
        """What Check answers for `service`; None: a NOT_FOUND error (both transports)."""
        status = self.status(service)
        if status is None and self.unknown_status:
            return SERVICE_UNKNOWN
        return status

    async def check(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        status = self.check_status(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return HealthCheckResponse(status=status)

    async def watch(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        last: int | None = -1
        while True:
            status = self.status(request.service)
            current = SERVICE_UNKNOWN if status is None else status
            if current != last:
                last = current
                yield HealthCheckResponse(status=current)
            await asyncio.sleep(self.watch_interval_s)

    def register(self, server: grpc.aio.Server) -> None:
        handlers = {
            "Check": grpc.unary_unary_rpc_method_handler(
                self.check,
                request_deserializer=HealthCheckRequest.FromString,
                response_serializer=HealthCheckResponse.SerializeToString,
            ),
            "Watch": grpc.unary_stream_rpc_method_handler(
                self.watch,
                request_deserializer=HealthCheckRequest.FromString,
                response_serializer=HealthCheckResponse.SerializeToString,
            ),
        }
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),)
        )


async def check_health(address: str, service: str = "", timeout_s: float = 2.0) -> int:
    """A client-side Check (for tests and `poolkeeper status`-like probes)."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_unary(
            f"/{SERVICE_NAME}/Check",
            request_serializer=HealthCheckRequest.SerializeToString,
            response_deserializer=HealthCheckResponse.FromString,
        )
        reply = await call(HealthCheckRequest(service=service), timeout=timeout_s)
        return int(reply.status)
