"""A lean keep-alive HTTP/1.1 GET for one metrics endpoint, on an asyncio Protocol.

Why not aiohttp: a scrape is one small GET every 50 ms per endpoint, and aiohttp's per-request
machinery (session, connector, response and stream objects, timer context) costs ~300 us of CPU
per GET of an 18 KB page on uvloop, this client ~120 us, the syscalls and loop wake-ups
included (docs/notes/2026-12-07-lean-scrape-client.md). It keeps one connection per endpoint,
reused while the server keeps it open, and parses responses with `backend/httpparse.py`. Same
guarantees as the aiohttp path: no redirects, one overall timeout (connect, head and body),
`Accept-Encoding: identity`, the size cap enforced while the body streams in, header size and
count caps, TLS through stdlib `ssl` for https. Errors are `HttpResponseError` with the message
`EndpointMetrics.error` shows, or TimeoutError.
"""

from __future__ import annotations

import asyncio
import ssl
from typing import cast

from poolkeeper.backend.httpparse import HttpResponseError, ResponseParser
from poolkeeper.hostport import join_hostport

__all__ = ["HttpResponseError", "KeepAliveGetter", "client_ssl_context"]


def client_ssl_context(verify: bool) -> ssl.SSLContext:
    """The TLS context for https scrapes: system trust store, or no verification at all."""
    context = ssl.create_default_context()
    if not verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


class _StaleConnection(HttpResponseError):
    """A reused connection closed before any byte of the response: safe to retry."""


class _Connection(asyncio.Protocol):
    """One TCP (or TLS) connection; at most one response in flight."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser: ResponseParser | None = None
        self.waiter: asyncio.Future[ResponseParser] | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's is not an asyncio.Transport subclass, only its shape).
        self.transport = cast("asyncio.Transport", transport)

    def data_received(self, data: bytes) -> None:
        parser, waiter = self.parser, self.waiter
        if parser is None or waiter is None or waiter.done():
            self.close()  # bytes nobody asked for: the connection is out of sync
            return
        try:
            if parser.feed(data):
                self.parser = None
                if not parser.keep_alive:
                    self.close()
                waiter.set_result(parser)
        except HttpResponseError as exc:
            self.parser = None
            self.close()
            waiter.set_exception(exc)

    def eof_received(self) -> bool:
        return False  # close our side too; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        parser, waiter = self.parser, self.waiter
        self.parser = None
        if parser is None or waiter is None or waiter.done():
            return
        try:
            parser.feed_eof(None if exc is None else _reason(exc))
        except HttpResponseError as error:
            if exc is not None and parser.received == 0:
                waiter.set_exception(HttpResponseError(f"connection lost: {_reason(exc)}"))
            else:
                waiter.set_exception(error)
        else:
            waiter.set_result(parser)

    def is_closed(self) -> bool:
        # A call, not the attribute: it changes under every await (mypy would narrow it).
        return self.closed

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class KeepAliveGetter:
    """GETs of one URL over one reused connection (not safe for concurrent `get` calls)."""

    def __init__(
        self,
        host: str,
        port: int,
        path: str,
        *,
        max_body: int,
        ssl_context: ssl.SSLContext | None = None,
        max_header_bytes: int = 64 * 1024,
        max_headers: int = 100,
    ) -> None:
        self._host = host
        self._port = port
        self._ssl = ssl_context
        self._max_body = max_body
        self._max_header_bytes = max_header_bytes
        self._max_headers = max_headers
        self._conn: _Connection | None = None
        self._request = (
            f"GET {path} HTTP/1.1\r\nHost: {join_hostport(host, port)}\r\n"
            "Accept: text/plain\r\nAccept-Encoding: identity\r\n"
            "User-Agent: poolkeeper-scraper\r\n\r\n"
        ).encode("latin-1")
        self.connections = 0  # connections opened, ever (tests and benchmarks read it)

    async def get(self, limit_s: float) -> ResponseParser:
        """One response (status, reason, location, body) within `limit_s` seconds overall.

        A reused connection that the server closed before answering (its idle timeout racing
        our request) is retried once on a fresh connection: a GET is safe to repeat.
        """
        async with asyncio.timeout(limit_s):
            try:
                try:
                    return await self._exchange()
                except _StaleConnection:
                    return await self._exchange()  # on a fresh connection
            except BaseException:
                self.close()  # failed, cancelled or timed out mid-response: state unknown
                raise

    async def _exchange(self) -> ResponseParser:
        conn = self._conn
        reused = conn is not None and not conn.closed
        if conn is None or conn.closed:
            conn = await self._connect()
        assert conn.transport is not None
        parser = ResponseParser(self._max_body, self._max_header_bytes, self._max_headers)
        waiter: asyncio.Future[ResponseParser] = asyncio.get_running_loop().create_future()
        if conn.is_closed():  # lost between the handshake and now: no callback would answer
            self._conn = None
            raise HttpResponseError("connection closed before any response")
        conn.parser, conn.waiter = parser, waiter
        conn.transport.write(self._request)
        try:
            response = await waiter
        except HttpResponseError as exc:
            if reused and parser.received == 0:
                raise _StaleConnection(str(exc)) from None
            raise
        finally:
            conn.waiter = None
        if conn.is_closed():
            self._conn = None
        return response

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(
                _Connection,
                self._host,
                self._port,
                ssl=self._ssl,
                server_hostname=self._host if self._ssl is not None else None,
            )
        except ssl.SSLError as exc:
            raise HttpResponseError(f"TLS handshake failed: {exc.reason or exc}") from None
        except OSError as exc:
            raise HttpResponseError(f"cannot connect: {_reason(exc)}") from None
        self.connections += 1
        self._conn = conn
        return conn

    def close(self) -> None:
        """Close the connection (the next `get` opens a new one)."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__
