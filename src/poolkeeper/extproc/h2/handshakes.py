"""TLS for the lean server, with the handshakes in progress in reach of `stop`.

With `loop.create_server(ssl=...)` asyncio keeps a connection to itself until its handshake is
done (the protocol hears of it only then), so the server's stop could not close a client that
connected and never finished the handshake: it kept its socket until asyncio's handshake
timeout (60 s), past any drain grace, and on Python 3.12+ `Server.wait_closed` waited for it.
Here the server accepts plain TCP and upgrades each connection with `loop.start_tls`, holding
the raw transport until the handshake ends: `abort_all` closes those still in it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Callable
from typing import cast

HANDSHAKE_TIMEOUT_S = 60.0  # asyncio's own default for `create_server(ssl=...)`


class TlsHandshakes:
    """A protocol factory for `create_server` (plain TCP) whose connections speak the
    protocols `make` returns once their TLS handshake with `context` is done."""

    def __init__(
        self,
        context: ssl.SSLContext,
        make: Callable[[], asyncio.Protocol],
        timeout_s: float = HANDSHAKE_TIMEOUT_S,
    ) -> None:
        self.context = context
        self.make = make
        self.timeout_s = timeout_s
        self._pending: dict[asyncio.Transport, asyncio.Task[None]] = {}

    def __call__(self) -> asyncio.Protocol:
        return _Accepted(self)

    @property
    def in_progress(self) -> int:
        """Connections accepted whose handshake has not ended yet."""
        return len(self._pending)

    def abort_all(self) -> None:
        """Close every connection still in its handshake (they hold no stream to drain)."""
        for transport, task in list(self._pending.items()):
            task.cancel()
            transport.abort()
        self._pending.clear()

    async def _upgrade(self, transport: asyncio.Transport) -> None:
        relay = _Relay(self.make())
        try:
            tls = await asyncio.get_running_loop().start_tls(
                transport,
                relay,
                self.context,
                server_side=True,
                ssl_handshake_timeout=self.timeout_s,
            )
        except (OSError, ssl.SSLError, TimeoutError, asyncio.CancelledError):
            # A failed or abandoned handshake ends the connection; the error is the peer's.
            transport.abort()
            return
        finally:
            self._pending.pop(transport, None)
        if tls is not None:
            relay.attach(tls)


class _Accepted(asyncio.Protocol):
    """A connection until `start_tls` takes it over (its reading paused meanwhile, so the
    client's first bytes are left for the TLS layer)."""

    def __init__(self, owner: TlsHandshakes) -> None:
        self.owner = owner
        self.raw: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's is not an asyncio.Transport subclass, only its shape).
        self.raw = raw = cast(asyncio.Transport, transport)
        raw.pause_reading()
        self.owner._pending[raw] = asyncio.get_running_loop().create_task(self.owner._upgrade(raw))

    def connection_lost(self, exc: Exception | None) -> None:
        """Lost before `start_tls` took over (which then hears of nothing): forget it."""
        task = self.owner._pending.pop(self.raw, None) if self.raw is not None else None
        if task is not None:
            task.cancel()


class _Relay(asyncio.Protocol):
    """The application protocol during the handshake: what arrives between its end and
    `attach` (the client's first bytes may come with its last handshake message) is kept and
    handed over in order."""

    def __init__(self, app: asyncio.Protocol) -> None:
        self.app = app
        self._data: list[bytes] = []
        self._eof = False
        self._lost = False

    def data_received(self, data: bytes) -> None:
        self._data.append(data)

    def eof_received(self) -> bool | None:
        self._eof = True
        return True  # keep the transport open until the application has heard of it

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True

    def attach(self, tls: asyncio.Transport) -> None:
        if self._lost:  # gone before the application ever saw it: nothing to tell
            return
        app = self.app
        tls.set_protocol(app)
        app.connection_made(tls)
        for data in self._data:
            if tls.is_closing():
                break
            app.data_received(data)
        self._data.clear()
        if self._eof and not tls.is_closing():
            with contextlib.suppress(Exception):
                if not app.eof_received():
                    tls.close()
