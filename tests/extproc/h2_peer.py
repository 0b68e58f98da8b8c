"""A raw HTTP/2 peer for the lean transport's tests: writes any frame, reads frames back.

Its header blocks come from `hpack.Encoder` (an independent HPACK implementation); frames are
built by hand so tests can send what a well-behaved client never would.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import hpack

from poolkeeper.extproc.h2 import frames as f
from poolkeeper.extproc.h2.limits import Limits
from poolkeeper.extproc.h2.rpc import Method, bidi
from poolkeeper.extproc.h2.server import LeanServer

PATH = "/test.Echo/Echo"
TOKEN_HEADER = "x-poolkeeper-epp-token"


@dataclass
class Frame:
    kind: int
    flags: int
    stream_id: int
    payload: bytes


def identity(data: bytes) -> bytes:
    return data


def echo_method(
    handler: Callable[[AsyncIterator[Any]], AsyncIterator[Any]] | None = None,
) -> Method:
    async def echo(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async for message in requests:
            yield message

    return bidi(handler or echo, identity, identity)


@contextlib.asynccontextmanager
async def lean(
    methods: dict[str, Method] | None = None, **kwargs: Any
) -> AsyncIterator[LeanServer]:
    server = LeanServer(methods or {PATH: echo_method()}, **kwargs)
    await server.listen("127.0.0.1", 0)
    try:
        yield server
    finally:
        await server.stop(None)


def grpc_message(payload: bytes) -> bytes:
    return struct.pack(">BL", 0, len(payload)) + payload


class Peer:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder()
        self.next_id = 1
        self.kept: dict[int, list[tuple[Frame, dict[str, str]]]] = {}

    @classmethod
    async def connect(cls, port: int, *, settings: dict[int, int] | None = None) -> Peer:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        peer = cls(reader, writer)
        # Unless told otherwise, windows so large that this peer never needs to update them.
        values = {f.INITIAL_WINDOW_SIZE: f.MAX_WINDOW, **(settings or {})}
        grow = f.window_update(0, f.MAX_WINDOW - f.DEFAULT_WINDOW)
        writer.write(f.PREFACE + f.settings(values) + grow)
        return peer

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    def headers_block(self, path: str = PATH, token: str | None = None) -> bytes:
        headers = [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "epp"),
                   ("content-type", "application/grpc"), ("te", "trailers")]  # fmt: skip
        if token is not None:
            headers.append((TOKEN_HEADER, token))
        return self.encoder.encode(headers)

    def open(self, path: str = PATH, *, end_stream: bool = False, token: str | None = None) -> int:
        stream_id, self.next_id = self.next_id, self.next_id + 2
        flags = f.END_HEADERS | (f.END_STREAM if end_stream else 0)
        self.send(f.frame(f.HEADERS, flags, stream_id, self.headers_block(path, token)))
        return stream_id

    def message(self, stream_id: int, payload: bytes, *, end_stream: bool = False) -> None:
        flags = f.END_STREAM if end_stream else 0
        self.send(f.frame(f.DATA, flags, stream_id, grpc_message(payload)))

    async def read_frame(self) -> Frame | None:
        """The next frame, None when the server closed the connection (10 s at most: the bound
        only ends a failing test)."""
        try:
            async with asyncio.timeout(10):
                head = await self.reader.readexactly(9)
                length, kind, flags, stream_id = f.parse_head(head, 0)
                payload = await self.reader.readexactly(length)
        except (asyncio.IncompleteReadError, ConnectionResetError):
            return None
        return Frame(kind, flags, stream_id, payload)

    async def until(self, kind: int, stream_id: int | None = None) -> Frame | None:
        """Frames until one of `kind` (on `stream_id`); None if the connection closed first."""
        while True:
            frame = await self.read_frame()
            if frame is None or (
                frame.kind == kind and (stream_id is None or frame.stream_id == stream_id)
            ):
                return frame

    async def response(self, stream_id: int) -> tuple[list[bytes], dict[str, str]]:
        """The messages and trailers of `stream_id`; other streams' frames are kept for their
        own `response` (header blocks are decoded as they arrive: HPACK's table is shared)."""
        data = b""
        messages: list[bytes] = []
        while True:
            kept = self.kept.get(stream_id)
            if kept:
                frame, fields = kept.pop(0)
            else:
                read = await self.read_frame()
                assert read is not None, "connection closed before the trailers"
                frame, fields = read, {}
                if frame.kind == f.HEADERS:
                    decoded = self.decoder.decode(frame.payload)
                    fields = {str(k): str(v) for k, v in decoded}
                if frame.kind == f.GOAWAY:
                    code, debug = f.u32(frame.payload[4:8]), frame.payload[8:]
                    raise AssertionError(f"GOAWAY {code}: {debug!r}")
                if frame.stream_id != stream_id:
                    if frame.stream_id:
                        self.kept.setdefault(frame.stream_id, []).append((frame, fields))
                    continue
            if frame.kind == f.HEADERS and frame.flags & f.END_STREAM:
                while len(data) >= 5:
                    size = struct.unpack_from(">L", data, 1)[0]
                    messages.append(data[5 : 5 + size])
                    data = data[5 + size :]
                self.kept.pop(stream_id, None)
                return messages, fields
            if frame.kind == f.DATA:
                data += frame.payload
            elif frame.kind == f.RST_STREAM:
                raise AssertionError(f"stream reset: {f.u32(frame.payload)}")

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()


def goaway_code(frame: Frame | None) -> int | None:
    return f.u32(frame.payload[4:8]) if frame is not None and frame.kind == f.GOAWAY else None


__all__ = ["Limits", "Peer", "echo_method", "goaway_code", "lean"]
