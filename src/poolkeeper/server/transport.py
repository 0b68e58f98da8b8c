"""The ext_proc port's server, by `listeners.extProcTransport`: grpc.aio or the lean transport.

Both serve the same servicer objects on the one port: ext_proc's Process, the response
observer's access log and first bytes, and gRPC health's Check (probes that name the ext_proc
port keep working). The lean transport's counters are exported as
`poolkeeper_extproc_transport_*` (docs/gateway.md, Transport).
"""

from __future__ import annotations

import ssl
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import grpc
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from poolkeeper.extproc.accesslog import DetachedExchanges
from poolkeeper.extproc.auth import EnvoyOnly
from poolkeeper.extproc.h2.limits import TransportStats
from poolkeeper.extproc.h2.rpc import Method, RpcError, unary
from poolkeeper.extproc.h2.server import LeanServer
from poolkeeper.extproc.lean import start_lean
from poolkeeper.extproc.server import ExtProcServicer, build_server
from poolkeeper.telemetry.health import (
    SERVICE_NAME,
    HealthCheckRequest,
    HealthCheckResponse,
    HealthService,
)

_NOT_FOUND = 5


class Stoppable(Protocol):
    async def start(self) -> None: ...
    async def stop(self, grace: float | None) -> Any: ...


def health_methods(health: HealthService) -> dict[str, Method]:
    """gRPC health's Check for the lean transport (Watch stays on the health port)."""

    async def check(request: Any) -> Any:
        status = health.check_status(request.service)
        if status is None:
            raise RpcError(_NOT_FOUND, f"unknown service {request.service!r}")
        return HealthCheckResponse(status=status)

    return {
        f"/{SERVICE_NAME}/Check": unary(
            check,
            HealthCheckRequest.FromString,
            HealthCheckResponse.SerializeToString,
            open=True,
        )
    }


async def start_extproc(
    transport: str,
    servicer: ExtProcServicer,
    address: str,
    port: int,
    *,
    health: HealthService,
    detached: DetachedExchanges | None,
    register: Callable[[grpc.aio.Server], None],
    interceptors: list[grpc.aio.ServerInterceptor] | None = None,
    token: str | None = None,
    tls: ssl.SSLContext | None = None,
    credentials: grpc.ServerCredentials | None = None,
) -> Stoppable:
    """The ext_proc port's server, listening (grpcio's is started by the caller with the
    others). `register` adds grpcio's extra services; `token` is the lean transport's form of
    grpcio's `interceptors` (calls without it are refused, health excepted); `credentials`:
    grpcio's TLS (`extproc.tls.server_credentials`), `tls` the lean transport's."""
    if transport == "lean":
        return await start_lean(
            servicer, address, port, detached=detached, token=token, tls=tls,
            more=health_methods(health),
        )  # fmt: skip
    server: Stoppable = build_server(
        servicer,
        f"{address}:{port}",
        extra=register,
        interceptors=interceptors or (),
        credentials=credentials,
    )[0]
    return server


def counters(prefix: str, *rows: tuple[str, int, str]) -> Iterator[CounterMetricFamily]:
    """One counter family per (name, value, help) row, named `prefix_name`."""
    for name, value, help_ in rows:
        yield CounterMetricFamily(f"{prefix}_{name}", help_, value=value)


def by_reason(name: str, help_: str, counts: dict[str, int]) -> CounterMetricFamily:
    """A counter family with one sample per `reason` label value, sorted."""
    family = CounterMetricFamily(name, help_, labels=["reason"])
    for reason, count in sorted(counts.items()):
        family.add_metric([reason], count)
    return family


class TransportCollector(Collector):
    """The lean transport's counters at scrape time."""

    def __init__(self, stats: TransportStats) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s, prefix = self.stats, "poolkeeper_extproc_transport"
        yield from counters(
            prefix,
            ("connections", s.connections, "Connections accepted on the ext_proc port."),
            (
                "refused_connections",
                s.refused_connections,
                "Connections closed on accept: the open-connection limit was reached.",
            ),
            ("streams", s.streams, "gRPC streams opened."),
            ("refused_streams", s.refused_streams, "Streams refused: over the limit, or draining."),
            ("premature_resets", s.premature_resets, "Streams reset while their handler ran."),
            ("unauthenticated", s.unauthenticated, "Streams without the gateway Envoy's token."),
            ("handler_errors", s.handler_errors, "Streams answered with grpc-status INTERNAL."),
        )
        yield by_reason(f"{prefix}_goaways", "Connections ended by GOAWAY, by reason.", s.goaways)
        yield GaugeMetricFamily(
            f"{prefix}_open_connections", "Open connections.", value=s.open_connections
        )
        yield GaugeMetricFamily(f"{prefix}_active_streams", "Open streams.", value=s.active_streams)


def refused_calls(server: Stoppable, guard: EnvoyOnly) -> Callable[[], int]:
    """Calls refused for want of Envoy's token, as the transport in use counts them."""
    if isinstance(server, LeanServer):
        stats = server.stats
        return lambda: stats.unauthenticated
    return lambda: guard.refused


def export_transport(registry: CollectorRegistry, server: Stoppable) -> None:
    if isinstance(server, LeanServer):
        registry.register(TransportCollector(server.stats))
