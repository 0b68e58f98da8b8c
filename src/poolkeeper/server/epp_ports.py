"""The EPP's own ports, as the runtime serves them: what the ext_proc servicer is told about the
wire (`extproc_settings`), which gRPC health answers (`health_service`), the services the
ext_proc server carries beside the servicer (`side_services`: health, and the response
observer's access-log and first-byte receivers), the gRPC health server, and the metrics site
with its HTTP probes (`metrics_runner`). Where they listen, the token, TLS and the transport
are the runtime's choice (`server/runtime.py`, `server/transport.py`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from aiohttp import web

from poolkeeper.config.gateway import GatewayConfigSpec
from poolkeeper.controller.source import ResourceSource
from poolkeeper.envoy.params import CLIENT_MAX_HEADER_KB, CLIENT_MAX_HEADERS
from poolkeeper.extproc.accesslog import AccessLogReceiver, DetachedExchanges, FirstByteReceiver
from poolkeeper.extproc.contracts import ExtProcSettings
from poolkeeper.telemetry.health import HealthService


def extproc_settings(spec: GatewayConfigSpec, *, own_bootstrap: bool) -> ExtProcSettings:
    """The ext_proc servicer's limits and answers from the request-handling and edge sections.
    `own_bootstrap`: behind poolkeeper's own Envoy bootstrap (`ServeOptions.own_bootstrap`)."""
    return ExtProcSettings(
        max_request_body_bytes=spec.request_handling.max_body_bytes + 1024,
        inference_paths=frozenset(p.rstrip("/") or "/" for p in spec.edge.inference_paths),
        # The client's header limits, under the listener's (envoy/params.py): 431 here,
        # before the routing headers could cross Envoy's limits and fail as the EPP's fault.
        client_header_limits=(CLIENT_MAX_HEADERS, CLIENT_MAX_HEADER_KB) if own_bootstrap else None,
        conformance_served_header=spec.request_handling.conformance_served_endpoint_header,
        answer_models=spec.request_handling.answer_models_list,
        max_streams=spec.request_handling.max_streams,
    )


def health_service(
    *,
    upstream: bool,
    source: ResourceSource | None,
    ready: Callable[[], bool],
    answering: Callable[[], bool],
) -> HealthService:
    """gRPC health as llm-d-router's EPP answers it (`upstream`: leader-aware, the source's
    `leading` when it has one), else the gateway's (`answering`: the EPP can route)."""
    if upstream:
        leading = getattr(source, "leading", None) or (lambda: None)
        return HealthService.for_upstream_epp(ready=ready, leading=leading)
    return HealthService.for_gateway(live=lambda: True, ready=ready, answering=answering)


def side_services(
    health: HealthService, detached: DetachedExchanges | None
) -> Callable[[grpc.aio.Server], None]:
    """What registers the services the ext_proc server carries beside the servicer: health,
    and with the response observer (`detached`) the receivers of its entries."""

    def register(server: grpc.aio.Server) -> None:
        health.register(server)
        if detached is not None:  # the response observer's entries arrive here
            AccessLogReceiver(detached).register(server)
            FirstByteReceiver(detached).register(server)

    return register


def health_server(health: HealthService, host: str, port: int) -> grpc.aio.Server:
    """The gRPC health server bound to `host:port`, not started (OSError when the port is
    taken)."""
    server = grpc.aio.server()
    health.register(server)
    if server.add_insecure_port(f"{host}:{port}") == 0:
        raise OSError(f"cannot bind the health server to port {port}")
    return server


def metrics_runner(
    app: web.Application, middlewares: tuple[Any, ...], ready: Callable[[], bool]
) -> web.AppRunner:
    """The metrics app's runner (not set up) with `middlewares` and, beside /metrics, HTTP
    probes for orchestrators without gRPC probes (/healthz, /readyz: `ready()`)."""
    app.middlewares.extend(middlewares)
    app.router.add_get("/healthz", http_probe(lambda: True))
    app.router.add_get("/readyz", http_probe(ready))
    return web.AppRunner(app, access_log=None)


def http_probe(probe: Callable[[], bool]) -> Callable[[web.Request], Awaitable[web.Response]]:
    """An HTTP handler answering 200 while `probe()` holds, else 503."""

    async def handler(_: web.Request) -> web.Response:
        ok = probe()
        return web.Response(status=200 if ok else 503, text="ok\n" if ok else "not ready\n")

    return handler
