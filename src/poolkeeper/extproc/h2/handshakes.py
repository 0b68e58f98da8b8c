"""TLS for the lean server, with the handshakes in progress in reach of `stop`.

With `loop.create_server(ssl=...)` asyncio keeps a connection to itself until its handshake is
done (the protocol hears of it only then), so the server's stop could not close a client that
connected and never finished the handshake: it kept its socket until asyncio's handshake
timeout (60 s), past any drain grace, and on Python 3.12+ `Server.wait_closed` waited for it.

Here the server accepts plain TCP and hands each accepted socket, before anything is read from
it, to `loop.connect_accepted_socket(ssl=...)`: the loop's own TLS layer then sees the
connection from its first byte, and the handshake is a task that `abort_all` can cancel (which
closes its socket). The socket is handed over as a duplicate and the accepting transport
aborted inside `connection_made`: an upgrade with `loop.start_tls` instead lost the client's
first bytes on uvloop, which starts reading right after `connection_made` (pausing there has
no effect), so a ClientHello that came before the upgrade was read by the plain protocol and
the handshake stalled until the client gave up (about one connection in four).
"""

from __future__ import annotations

import asyncio
import os
import socket
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
        self._pending: set[asyncio.Task[None]] = set()

    def __call__(self) -> asyncio.Protocol:
        return _Accepted(self)

    @property
    def in_progress(self) -> int:
        """Connections accepted whose handshake has not ended yet."""
        return len(self._pending)

    def abort_all(self) -> None:
        """Close every connection still in its handshake (they hold no stream to drain):
        a cancelled `connect_accepted_socket` closes its transport."""
        for task in list(self._pending):
            task.cancel()
        self._pending.clear()

    def hand_over(self, sock: socket.socket) -> None:
        task = asyncio.get_running_loop().create_task(self._handshake(sock))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _handshake(self, sock: socket.socket) -> None:
        try:
            await asyncio.get_running_loop().connect_accepted_socket(
                self.make, sock, ssl=self.context, ssl_handshake_timeout=self.timeout_s
            )
        except (OSError, ssl.SSLError, TimeoutError):
            # A failed or abandoned handshake ends the connection; the error is the peer's.
            sock.close()


class _Accepted(asyncio.Protocol):
    """The accepting side: takes the socket away from the plain transport at once."""

    def __init__(self, owner: TlsHandshakes) -> None:
        self.owner = owner

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's is not an asyncio.Transport subclass, only its shape).
        stream = cast(asyncio.Transport, transport)
        raw = stream.get_extra_info("socket")
        try:
            sock = socket.socket(fileno=os.dup(raw.fileno()))
        except OSError:
            stream.abort()
            return
        # Aborted inside connection_made, the transport never starts reading (asyncio and
        # uvloop both check for it), so every byte the client sent is left for the TLS layer;
        # closing its descriptor leaves the connection open on the duplicate.
        stream.abort()
        sock.setblocking(False)
        self.owner.hand_over(sock)
