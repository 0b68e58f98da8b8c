"""One keep-alive HTTP/1.1 chat request from a chosen source address, read to the end of its
answer (Content-Length or chunked), for tests of per-client-address connection caps."""

from __future__ import annotations

import asyncio

Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def chat_from(
    port: int, source: str, body: bytes, conn: Conn | None = None
) -> tuple[bytes, Conn]:
    """POST `body` to /v1/chat/completions on 127.0.0.1:`port` from `source`, on `conn` or a
    new connection: the status line (b"" if the connection was closed unanswered) and the
    connection, its answer read whole so that it can carry the next request."""
    if conn is None:
        conn = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    reader, writer = conn
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%b" % (len(body), body)
    )
    await writer.drain()
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    except (asyncio.IncompleteReadError, ConnectionError):
        return b"", conn
    fields = [line.lower() for line in head.split(b"\r\n")]
    if b"transfer-encoding: chunked" in fields:
        await asyncio.wait_for(reader.readuntil(b"\r\n0\r\n\r\n"), 10)  # the last chunk
    else:
        length = next(int(f.split(b":", 1)[1]) for f in fields if f.startswith(b"content-length:"))
        await asyncio.wait_for(reader.readexactly(length), 10)
    return head.split(b"\r\n", 1)[0], conn
