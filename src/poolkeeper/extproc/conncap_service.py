"""The connection counter's gRPC service for Envoy (the counter: extproc/conncap.py).

Envoy's network ext_authz `Check` on each connection's first bytes, its listener's TCP access
log (`StreamAccessLogs`) for every close, and, while the server runs, the kernel's list of
the listener's open connections that have sent bytes (extproc/tcpdiag.py), which settles what
the two streams cannot: connections Envoy let in because their check timed out (grpc.aio
drops a call Envoy cancelled before its handler ran), and closes that were lost. `serve` runs
it on a thread and loop of its own (server/own_loop.py), on loopback with the run's Envoy
token, like the EPP's other services (extproc/auth); `poolkeeper bbr` adds it to its ext_proc
server for the body-based routing Envoy (`add_conncap_service`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import grpc
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from envoy.service.auth.v3 import external_auth_pb2 as auth_pb2, external_auth_pb2_grpc
from google.rpc import code_pb2, status_pb2  # type: ignore[import-untyped]

from poolkeeper.extproc.auth import EnvoyOnly
from poolkeeper.extproc.conncap import ConnectionCounter
from poolkeeper.extproc.tcpdiag import connection_open, peers_that_sent

log = logging.getLogger(__name__)

_ALLOW = auth_pb2.CheckResponse(status=status_pb2.Status(code=code_pb2.OK))
_DENY = auth_pb2.CheckResponse(status=status_pb2.Status(code=code_pb2.PERMISSION_DENIED))

# Whether a connection is open: its end on this host (address, port), its peer's; None: unknown.
Lookup = Callable[[tuple[str, int], tuple[str, int]], bool | None]
# The peers of the open connections on a local port that have sent bytes; None: unknown.
Peers = Callable[[int], set[tuple[str, int]] | None]
# The kernel's list is taken every check deadline plus this.
RECONCILE_EXTRA_S = 0.5


class ConnectionCapService(
    external_auth_pb2_grpc.AuthorizationServicer,  # type: ignore[misc]
    als_pb2_grpc.AccessLogServiceServicer,  # type: ignore[misc]
):
    """Envoy's ext_authz `Check` (one per connection) and its listener's TCP access log."""

    def __init__(
        self,
        counter: ConnectionCounter,
        check_timeout_s: float | None = None,
        lookup: Lookup = connection_open,
        listen_port: int = 0,
        peers: Peers = peers_that_sent,
        learn_listen_port: bool = False,
    ) -> None:
        self.counter = counter
        # Envoy's timeout for a check: with the deadline it gives when the check arrived.
        self.check_timeout_s = check_timeout_s
        self.lookup = lookup  # is a connection still open (the kernel's word, tcpdiag)
        # Envoy's public listener (0: not reconciled) and the kernel's list of its connections.
        self.listen_port = listen_port
        self.peers = peers
        # Without a `listen_port`: take the first check's destination port as the listener's
        # (`poolkeeper bbr`, whose Envoy on this host is configured elsewhere).
        self.learn_listen_port = learn_listen_port
        self._reconciler: asyncio.Task[None] | None = None

    def start_reconciling(self) -> None:
        """Take the kernel's list from now on, on the running loop (the server's, which
        cancels it when it ends); nothing without a `listen_port`."""
        if self.listen_port and self._reconciler is None:
            self._reconciler = asyncio.get_running_loop().create_task(self._reconcile())

    async def _reconcile(self) -> None:
        """The kernel's list, every check deadline plus `RECONCILE_EXTRA_S` (a check
        outstanding at one list is settled by the next). Taken on this loop: a few ms of
        netlink, less than a thread hop costs under load."""
        every_s = (self.check_timeout_s or 1.0) + RECONCILE_EXTRA_S
        while True:
            await asyncio.sleep(every_s)
            sent = self.peers(self.listen_port)
            if sent is not None:
                self.counter.reconcile(sent)

    async def Check(
        self, request: auth_pb2.CheckRequest, context: grpc.aio.ServicerContext | None = None
    ) -> auth_pb2.CheckResponse:
        source = request.attributes.source.address.socket_address
        if not source.address:
            return _ALLOW  # a Unix socket or an unknown peer: nothing to count by
        local = request.attributes.destination.address.socket_address
        here, there = (local.address, local.port_value), (source.address, source.port_value)
        if self.learn_listen_port and not self.listen_port and local.port_value:
            # Said, since a wrong port (a forged first check) would forget every count
            # (`poolkeeper bbr --envoy-port` pins it instead).
            self.listen_port = local.port_value
            log.info(
                "connection counter: settling counts from port %d's connections", local.port_value
            )
            self.start_reconciling()
        still_open = (lambda: self.lookup(here, there)) if local.address else None
        arrived = None
        if context is not None:
            remaining = context.time_remaining()
            if context.cancelled() or (remaining is not None and remaining <= 0):
                # Envoy has let the connection in (timeout) or closed it: the answer is moot.
                self.counter.let_in_late(source.address, source.port_value, still_open)
                return _ALLOW
            if remaining is not None and self.check_timeout_s is not None:
                arrived = self.counter.now() - (self.check_timeout_s - remaining)
        allowed = self.counter.opened(source.address, source.port_value, arrived, still_open)
        return _ALLOW if allowed else _DENY

    async def StreamAccessLogs(
        self,
        request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage],
        context: grpc.aio.ServicerContext | None = None,
    ) -> als_pb2.StreamAccessLogsResponse:
        try:
            async for message in request_iterator:
                for entry in message.tcp_logs.log_entry:
                    common = entry.common_properties
                    peer = common.downstream_remote_address.socket_address
                    self.counter.closed(peer.address, peer.port_value, _closed_at(common))
        finally:
            # Envoy keeps this stream for its lifetime: its end may have lost closes.
            self.counter.clear()
        return als_pb2.StreamAccessLogsResponse()


def _closed_at(common: accesslog_pb2.AccessLogCommon) -> float | None:
    """When the connection closed (wall clock, from Envoy's start time and duration)."""
    if not common.HasField("start_time"):
        return None
    nanoseconds: int = common.start_time.ToNanoseconds() + common.duration.ToNanoseconds()
    return nanoseconds / 1e9


def add_conncap_service(
    server: grpc.aio.Server,
    counter: ConnectionCounter,
    check_timeout_s: float | None = None,
    listen_port: int = 0,
    learn_listen_port: bool = False,
) -> ConnectionCapService:
    """The service's two methods on `server` (serve's own server below, or `poolkeeper bbr`'s
    ext_proc server, which its Envoy asks). Call it on the loop that will run the server:
    with a `listen_port` (or one learnt from the first check), the kernel's list is taken from
    then on."""
    service = ConnectionCapService(
        counter, check_timeout_s, listen_port=listen_port, learn_listen_port=learn_listen_port
    )
    external_auth_pb2_grpc.add_AuthorizationServicer_to_server(service, server)
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(service, server)
    service.start_reconciling()
    return service


def build_conncap_server(
    counter: ConnectionCounter,
    host: str,
    token: str | None,
    check_timeout_s: float | None = None,
    listen_port: int = 0,
) -> tuple[grpc.aio.Server, int]:
    """The service on `host` (loopback), any free port; calls without `token` are refused.
    `check_timeout_s`: the timeout Envoy gives each check (`conncap_timeout_s`);
    `listen_port`: Envoy's public listener, whose connections are reconciled with the kernel
    (from now on: call this on the loop that will run the server, as grpc.aio wants anyway)."""
    server = grpc.aio.server(interceptors=[EnvoyOnly(token)] if token is not None else [])
    add_conncap_service(server, counter, check_timeout_s, listen_port)
    port = server.add_insecure_port(f"{host}:0")
    if port == 0:
        raise OSError(f"cannot bind the connection counter to {host}")
    return server, port
