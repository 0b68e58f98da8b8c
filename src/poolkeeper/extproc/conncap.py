"""The per-client-address connection cap: counts each address's open connections for Envoy.

Envoy 1.40 has no per-source-address connection limit (its connection_limit filter counts one
filter chain, the overload manager the whole process). The managed Envoy asks this service
instead: its network ext_authz filter calls `Check` on a connection's first bytes (a silent
connection is left to the idle timeout), and a listener access log reports every connection's
close (`StreamAccessLogs`, TCP entries), so the count per address is exact while that log
stream runs. A connection over `limit` from one address is refused: Envoy closes it.

Fails open everywhere it cannot be sure: Envoy's filter allows a connection when this service
is unreachable or slow (`failure_mode_allow`); a connection the full table cannot hold is
allowed untracked; and when a log stream ends (Envoy stopped or crashed, its closes lost) the
table is emptied rather than keep addresses locked out by connections that no longer exist.
Served on loopback with the run's Envoy token, like the EPP's other services (extproc/auth).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from envoy.service.auth.v3 import external_auth_pb2 as auth_pb2, external_auth_pb2_grpc
from google.rpc import code_pb2, status_pb2  # type: ignore[import-untyped]

from poolkeeper.extproc.auth import EnvoyOnly

log = logging.getLogger("poolkeeper.extproc")

_ALLOW = auth_pb2.CheckResponse(status=status_pb2.Status(code=code_pb2.OK))
_DENY = auth_pb2.CheckResponse(status=status_pb2.Status(code=code_pb2.PERMISSION_DENIED))


@dataclass(slots=True)
class ConnectionCounts:
    """Exported figures (poolkeeper_client_connections*)."""

    open: int  # connections counted now
    addresses: int  # distinct client addresses among them
    refused: int  # connections refused at the per-address limit, since start
    untracked: int  # allowed without counting: the table was full, since start
    cleared: int  # times the table was emptied because a log stream ended


class ConnectionCounter:
    """Open connections by client address (`ip` -> its connections' source ports)."""

    def __init__(self, limit: int, *, max_tracked: int = 65_536) -> None:
        self.limit = limit
        self.max_tracked = max_tracked  # connections held in the table, all addresses
        self._ports: dict[str, set[int]] = {}
        self._open = 0
        self.refused = 0
        self.untracked = 0
        self.cleared = 0

    def opened(self, ip: str, port: int) -> bool:
        """A connection sent its first bytes: False if `ip` already holds `limit`."""
        ports = self._ports.get(ip)
        if ports is not None and len(ports) >= self.limit:
            self.refused += 1
            if self.refused == 1 or self.refused % 1000 == 0:  # never a line per connection
                log.warning(
                    "refused %d connection(s) over %d per client address (latest from %s)",
                    self.refused, self.limit, ip,
                )  # fmt: skip
            return False
        if self._open >= self.max_tracked:
            self.untracked += 1  # bounded memory first: allowed, not counted
            return True
        if ports is None:
            ports = self._ports[ip] = set()
        if port not in ports:
            ports.add(port)
            self._open += 1
        return True

    def closed(self, ip: str, port: int) -> None:
        """A connection closed (unknown ones: silent, refused or untracked: ignored)."""
        ports = self._ports.get(ip)
        if ports is None or port not in ports:
            return
        ports.discard(port)
        self._open -= 1
        if not ports:
            del self._ports[ip]

    def clear(self) -> None:
        """Forget every connection: their closes may never be reported (fail open)."""
        if self._open:
            log.warning("connection counts reset: %d connection(s) forgotten", self._open)
        self._ports.clear()
        self._open = 0
        self.cleared += 1

    def exported(self) -> tuple[int, int, int, int]:
        """(open, addresses, refused, untracked), as telemetry exports them."""
        return self._open, len(self._ports), self.refused, self.untracked

    def counts(self) -> ConnectionCounts:
        return ConnectionCounts(
            self._open, len(self._ports), self.refused, self.untracked, self.cleared
        )


class ConnectionCapService(
    external_auth_pb2_grpc.AuthorizationServicer,  # type: ignore[misc]
    als_pb2_grpc.AccessLogServiceServicer,  # type: ignore[misc]
):
    """Envoy's ext_authz `Check` (one per connection) and its listener's TCP access log."""

    def __init__(self, counter: ConnectionCounter) -> None:
        self.counter = counter

    async def Check(
        self, request: auth_pb2.CheckRequest, context: grpc.aio.ServicerContext | None = None
    ) -> auth_pb2.CheckResponse:
        source = request.attributes.source.address.socket_address
        if not source.address:
            return _ALLOW  # a Unix socket or an unknown peer: nothing to count by
        return _ALLOW if self.counter.opened(source.address, source.port_value) else _DENY

    async def StreamAccessLogs(
        self,
        request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage],
        context: grpc.aio.ServicerContext | None = None,
    ) -> als_pb2.StreamAccessLogsResponse:
        try:
            async for message in request_iterator:
                for entry in message.tcp_logs.log_entry:
                    peer = entry.common_properties.downstream_remote_address.socket_address
                    self.counter.closed(peer.address, peer.port_value)
        finally:
            # Envoy keeps this stream for its lifetime: its end may have lost closes.
            self.counter.clear()
        return als_pb2.StreamAccessLogsResponse()


def build_conncap_server(
    counter: ConnectionCounter, host: str, token: str | None
) -> tuple[grpc.aio.Server, int]:
    """The service on `host` (loopback), any free port; calls without `token` are refused."""
    server = grpc.aio.server(interceptors=[EnvoyOnly(token)] if token is not None else [])
    service = ConnectionCapService(counter)
    external_auth_pb2_grpc.add_AuthorizationServicer_to_server(service, server)
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(service, server)
    port = server.add_insecure_port(f"{host}:0")
    if port == 0:
        raise OSError(f"cannot bind the connection counter to {host}")
    return server, port
