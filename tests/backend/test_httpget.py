"""The lean keep-alive GET (backend/httpget.py) against scripted servers on 127.0.0.1.

Each server reads request heads and answers what the test scripts, byte for byte, so the
client's handling of reuse, closes, chunking, caps, timeouts and garbage is observed on a real
socket.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import struct
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from poolkeeper.backend.config import ScrapingConfig
from poolkeeper.backend.httpget import HttpResponseError, KeepAliveGetter, client_ssl_context
from poolkeeper.backend.scraper import MetricsScraper
from poolkeeper.datastore.endpoint import Endpoint, EndpointMetrics
from poolkeeper.extproc.tls_certs import self_signed_pair

VLLM_PAGE = (Path(__file__).parent / "fixtures" / "vllm_v1.prom").read_bytes()

pytestmark = pytest.mark.integration

# One scripted answer: pieces to write (bytes, or a float to sleep that many seconds), and
# whether to close the connection afterwards.
Answer = tuple[list[bytes | float], bool]


def ok(body: bytes, *extra: str) -> bytes:
    head = "".join(f"{h}\r\n" for h in extra)
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n" % (len(body), head.encode()) + body


@dataclass
class Scripted:
    answer: Callable[[int], Answer]
    port: int = 0
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)


@asynccontextmanager
async def scripted(
    answer: Callable[[int], Answer], tls: ssl.SSLContext | None = None
) -> AsyncIterator[Scripted]:
    state = Scripted(answer)

    handlers: set[asyncio.Task[None]] = set()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        state.connections += 1
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                state.requests.append(head)
                pieces, close = state.answer(len(state.requests))
                for piece in pieces:
                    if isinstance(piece, float):
                        await asyncio.sleep(piece)
                    else:
                        writer.write(piece)
                        await writer.drain()
                if close:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except asyncio.CancelledError:
            pass  # stopped by the teardown below; ending normally keeps asyncio's log quiet
        finally:
            writer.close()
            handlers.discard(task)

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=tls)
    state.port = server.sockets[0].getsockname()[1]
    try:
        yield state
    finally:
        server.close()
        for task in list(handlers):
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        await server.wait_closed()


def getter(port: int, max_body: int = 4 * 1024 * 1024, **kw: object) -> KeepAliveGetter:
    return KeepAliveGetter("127.0.0.1", port, "/metrics", max_body=max_body, **kw)  # type: ignore[arg-type]


async def test_one_connection_is_reused_and_the_request_is_lean() -> None:
    async with scripted(lambda _n: ([ok(VLLM_PAGE)], False)) as server:
        client = getter(server.port)
        for _ in range(3):
            response = await client.get(1.0)
            assert (response.status, response.body) == (200, VLLM_PAGE)
        client.close()
    assert (server.connections, client.connections) == (1, 1)
    head = server.requests[0]
    assert head.startswith(b"GET /metrics HTTP/1.1\r\n")
    assert b"Host: 127.0.0.1:" in head
    assert b"Accept-Encoding: identity\r\n" in head


async def test_connection_close_is_honoured_and_the_next_get_reconnects() -> None:
    async with scripted(lambda _n: ([ok(b"a 1\n", "Connection: close")], True)) as server:
        client = getter(server.port)
        for _ in range(3):
            assert (await client.get(1.0)).body == b"a 1\n"
        client.close()
    assert server.connections == 3


async def test_a_server_closing_an_idle_connection_is_noticed() -> None:
    # The server answers, then closes while the connection idles: the next get reconnects.
    async with scripted(lambda n: ([ok(b"x 1\n")], n % 2 == 1)) as server:
        client = getter(server.port)
        assert (await client.get(1.0)).body == b"x 1\n"
        await asyncio.sleep(0.05)  # the server's close arrives while idle
        assert (await client.get(1.0)).body == b"x 1\n"
        client.close()
    assert server.connections == 2


async def test_a_reused_connection_closed_before_answering_is_retried_once() -> None:
    # The race of a server's idle timeout with our request: request 2 arrives on the kept
    # connection and is dropped unanswered; the client repeats it on a fresh connection.
    async with scripted(lambda n: ([] if n == 2 else [ok(b"x 1\n")], n == 2)) as server:
        client = getter(server.port)
        assert (await client.get(1.0)).body == b"x 1\n"
        assert (await client.get(1.0)).body == b"x 1\n"
        client.close()
    assert (server.connections, len(server.requests)) == (2, 3)


async def test_a_reset_cutting_a_close_delimited_body_is_an_error() -> None:
    """A body without a length ends at the server's clean close; a reset after part of it
    (here 3 bytes, the client has read them) was taken as the whole page."""
    client: KeepAliveGetter | None = None

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.0 200 OK\r\n\r\nabc")
        await writer.drain()
        for _ in range(1000):  # until the client has read those bytes (same loop: no sleep)
            conn = client._conn if client is not None else None
            if conn is not None and conn.parser is not None and conn.parser.received:
                break
            await asyncio.sleep(0)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()  # linger 0: a reset, not a FIN

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        client = getter(server.sockets[0].getsockname()[1])
        with pytest.raises(HttpResponseError) as caught:
            await client.get(5.0)
        assert str(caught.value) == (
            "connection lost after 3 bytes of a body delimited by the connection's close: "
            "Connection reset by peer"
        )
    finally:
        server.close()
        await server.wait_closed()


async def test_chunked_body_with_extensions_and_trailers() -> None:
    body = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"4;ext=1\r\nab\r\n\r\n" + b"3\r\ncd\n\r\n" + b"0\r\nX-Trailer: t\r\n\r\n"
    )
    async with scripted(lambda _n: ([body[:30], 0.01, body[30:]], False)) as server:
        client = getter(server.port)
        assert (await client.get(1.0)).body == b"ab\r\ncd\n"
        assert (await client.get(1.0)).body == b"ab\r\ncd\n"  # still in sync: reused
        client.close()
    assert server.connections == 1


async def test_interim_responses_are_skipped_and_leading_zeros_read() -> None:
    """A 103 Early Hints (its head trickled byte by byte) before the page is skipped, as RFC
    9110 asks of a client; a Content-Length and a chunk size with leading zeros are read."""
    early = b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>\r\n\r\n"
    page = b"HTTP/1.1 200 OK\r\nContent-Length: 00000000000000000005\r\n\r\nhello"
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0003\r\nabc\r\n0\r\n\r\n"

    def answer(n: int) -> Answer:
        if n == 1:
            return [*(early[i : i + 1] for i in range(len(early))), page], False
        return [chunked], False

    async with scripted(answer) as server:
        client = getter(server.port)
        first = await client.get(1.0)
        assert (first.status, first.body) == (200, b"hello")
        assert (await client.get(1.0)).body == b"abc"  # in sync after the interim response
        client.close()
    assert server.connections == 1


async def test_a_streamed_body_over_the_cap_is_cut_off() -> None:
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    chunk = b"4000\r\n" + b"#" * 0x4000 + b"\r\n"
    pieces: list[bytes | float] = [head, *[chunk] * 8]
    async with scripted(lambda _n: (pieces, False)) as server:
        client = getter(server.port, max_body=50_000)
        with pytest.raises(HttpResponseError, match="exceeds the 50000-byte limit"):
            await client.get(1.0)
    # A close-delimited body is capped the same way.
    async with scripted(lambda _n: ([b"HTTP/1.0 200 OK\r\n\r\n", b"#" * 60_000], True)) as s2:
        with pytest.raises(HttpResponseError, match="response exceeds the 50000-byte limit"):
            await getter(s2.port, max_body=50_000).get(1.0)


async def test_a_declared_length_over_the_cap_is_refused() -> None:
    async with scripted(lambda _n: ([ok(b"x" * 5000)], False)) as server:
        with pytest.raises(HttpResponseError, match="response of 5000 bytes exceeds the 1024"):
            await getter(server.port, max_body=1024).get(1.0)


async def test_a_slow_body_hits_the_overall_timeout_and_the_connection_is_dropped() -> None:
    trickle: list[bytes | float] = [b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n"]
    trickle += [b"x", 0.05] * 100
    async with scripted(lambda n: (trickle if n == 1 else [ok(b"y 1\n")], False)) as server:
        client = getter(server.port)
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(TimeoutError):
            await client.get(0.2)
        assert loop.time() - started < 2.0
        # The half-read response is not mistaken for the next one: a fresh connection.
        assert (await client.get(1.0)).body == b"y 1\n"
        client.close()
    assert server.connections == 2


async def test_a_redirect_is_reported_not_followed() -> None:
    answer = b"HTTP/1.1 302 Found\r\nLocation: /elsewhere\r\nContent-Length: 0\r\n\r\n"
    async with scripted(lambda _n: ([answer], False)) as server:
        sink: list[EndpointMetrics] = []
        scraper = MetricsScraper(
            Endpoint("s", "127.0.0.1", server.port),
            None,
            ScrapingConfig(),
            lambda _k, m: sink.append(m),
        )
        metrics = await scraper.scrape_once()
        scraper.close()
    assert metrics.error == "HTTP 302 redirect to /elsewhere not followed"
    assert len(server.requests) == 1


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (b"SSH-2.0-OpenSSH_9.6\r\n\r\n", "garbage status line b'SSH-2.0"),
        (b"HTTP/1.1 2000 OK\r\n\r\n", "garbage status line"),
        (b"HTTP/1.1 200 OK\r\nNo colon here\r\n\r\n", "malformed header line"),
        (b"HTTP/1.1 200 OK\r\n folded: x\r\n\r\n", "malformed header line"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", "conflicting"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "bad Content-Length '-1'"),
        (b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\n\r\n", "Content-Encoding 'gzip'"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n", "Transfer-Encoding 'gzip'"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "bad chunk size"),
        # An interim response is skipped; the real one never came.
        (b"HTTP/1.1 100 Continue\r\n\r\n", "connection closed in the response head"),
        (b"HTTP/1.1 101 Switching Protocols\r\n\r\n", "unexpected protocol switch"),
        # Unicode digits (here a superscript two) are not a length: a precise error, not int()'s.
        (
            "HTTP/1.1 200 OK\r\nContent-Length: \u00b2\r\n\r\n".encode("latin-1"),
            "bad Content-Length",
        ),
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc",
            "closed after 3 bytes of the body of 10",
        ),
        (b"HTTP/1.1 200 O", "connection closed in the response head after 14 bytes"),
        # A bare LF was refused as "closed in the response head": the line is named now.
        (b"HTTP/1.1 200 OK\nContent-Length: 2\n\nhi", "bare LF line ending (no CR)"),
        (b"", "connection closed before any response"),
    ],
)
async def test_bad_responses_get_precise_errors(answer: bytes, message: str) -> None:
    async with scripted(lambda _n: ([answer], True)) as server:
        with pytest.raises(HttpResponseError) as caught:
            await getter(server.port).get(1.0)
    assert message in str(caught.value)


async def test_header_floods_are_refused() -> None:
    many = b"HTTP/1.1 200 OK\r\n" + b"X-A: b\r\n" * 101 + b"Content-Length: 0\r\n\r\n"
    huge = b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 70_000
    async with scripted(lambda n: ([many if n == 1 else huge], False)) as server:
        client = getter(server.port)
        with pytest.raises(HttpResponseError, match="more than 100 response headers"):
            await client.get(1.0)
        with pytest.raises(HttpResponseError, match="response head exceeds 65536 bytes"):
            await client.get(1.0)
        client.close()


async def test_refused_connection_is_named() -> None:
    async with scripted(lambda _n: ([], True)) as server:
        port = server.port
    with pytest.raises(HttpResponseError, match=r"^cannot connect: "):
        await getter(port).get(1.0)


async def test_https_with_and_without_verification(tmp_path: Path) -> None:
    cert, key = self_signed_pair()
    (tmp_path / "c.pem").write_bytes(cert)
    (tmp_path / "k.pem").write_bytes(key)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(tmp_path / "c.pem", tmp_path / "k.pem")
    async with scripted(lambda _n: ([ok(b"t 1\n")], False), tls=tls) as server:
        skip = getter(server.port, ssl_context=client_ssl_context(verify=False))
        assert (await skip.get(2.0)).body == b"t 1\n"
        assert (await skip.get(2.0)).body == b"t 1\n"
        skip.close()
        strict = getter(server.port, ssl_context=client_ssl_context(verify=True))
        with pytest.raises(HttpResponseError, match="TLS handshake failed"):
            await strict.get(2.0)
    assert server.connections == 1  # the refused handshake never reaches the handler
