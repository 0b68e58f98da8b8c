"""The lean transport's listener: methods by path, TLS with ALPN h2, drain, counters.

`LeanServer` has grpc.aio.Server's lifecycle (`start`, `stop(grace)`), so the runtime stops
both kinds alike. Stopping drains: the listener closes, every connection gets GOAWAY(NO_ERROR)
naming the last stream it will finish, and after `grace` seconds whatever still runs is cut;
connections still in their TLS handshake are closed at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Mapping

from poolkeeper.extproc.h2.connection import Connection
from poolkeeper.extproc.h2.handshakes import TlsHandshakes
from poolkeeper.extproc.h2.limits import Limits, TransportStats
from poolkeeper.extproc.h2.rpc import Method
from poolkeeper.extproc.h2.shared import Shared


def tls_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    """A server context for HTTP/2 over TLS: TLS 1.2 or later, ALPN h2 (RFC 9113 section 9.2)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert_file, key_file)
    context.set_alpn_protocols(["h2"])
    return context


class LeanServer:
    def __init__(
        self,
        methods: Mapping[str, Method],
        *,
        limits: Limits | None = None,
        token: str | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.stats = TransportStats()
        self._shared = Shared(
            methods={path.encode(): method for path, method in methods.items()},
            limits=limits or Limits(),
            stats=self.stats,
            token=token.encode() if token is not None else None,
        )
        # With TLS, connections are accepted as plain TCP and upgraded, so that `stop` can
        # close the ones still in their handshake (handshakes.py).
        self._handshakes = (
            TlsHandshakes(tls, lambda: Connection(self._shared)) if tls is not None else None
        )
        self._server: asyncio.Server | None = None
        self.port = 0

    async def listen(self, host: str, port: int) -> int:
        """Bind `host:port` (0: any free port) and serve; returns the port."""
        loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_server(
                self._handshakes or (lambda: Connection(self._shared)),
                host,
                port,
                reuse_address=True,
            )
        except OSError as error:
            raise OSError(f"cannot bind the ext_proc server to {host}:{port}: {error}") from None
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def start(self) -> None:
        """Nothing left to do: `listen` already serves (grpc.aio.Server's shape)."""

    @property
    def handshakes_in_progress(self) -> int:
        return self._handshakes.in_progress if self._handshakes is not None else 0

    @property
    def active_streams(self) -> int:
        return sum(c.active for c in self._shared.connections)

    async def stop(self, grace: float | None = None) -> None:
        shared = self._shared
        shared.draining = True
        shared.flush_refusals(asyncio.get_running_loop().time())
        if self._server is not None:
            self._server.close()
        if self._handshakes is not None:
            self._handshakes.abort_all()  # no stream to drain on them
        for connection in list(shared.connections):
            connection.goaway()
        if grace and shared.connections:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(shared.idle.wait(), grace)
        for connection in list(shared.connections):
            connection.close()
        await asyncio.sleep(0)  # let connection_lost cancel the handlers still running
        if self._server is not None:
            await self._server.wait_closed()
