"""The gRPC side of the lean transport: methods, message framing, a stream's inbox, statuses.

Every method is driven in one shape, the ext_proc servicer's: an async iterator of decoded
requests in, an async iterator of replies out. Unary and client-streaming handlers (access log,
first byte, health) are adapted to it here, so the connection knows only that one shape.
"""

from __future__ import annotations

import asyncio
import struct
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from poolkeeper.extproc.h2.frames import literal

# gRPC status codes used by the transport (grpc/doc/statuscodes.md).
OK, UNKNOWN, INVALID_ARGUMENT, RESOURCE_EXHAUSTED = 0, 2, 3, 8
UNIMPLEMENTED, INTERNAL, UNAVAILABLE, UNAUTHENTICATED = 12, 13, 14, 16

Handler = Callable[[AsyncIterator[Any]], AsyncIterator[Any]]
_PREFIX = struct.Struct(">BL")
# A whole gRPC message (prefix included) as pieces written in order: an `enveloped` encoder
# may return one, so that a large message's bytes reach the socket as views, never joined.
Pieces = tuple[bytes | memoryview, ...]


@dataclass(frozen=True, slots=True)
class Method:
    decode: Callable[[bytes], Any]
    encode: Callable[[Any], bytes | Pieces]  # Pieces only when `enveloped`
    handler: Handler
    open: bool = False  # callable without the gateway Envoy's token (health)
    enveloped: bool = False  # `encode` writes the gRPC message prefix itself (`envelope`)


def bidi(
    handler: Handler,
    decode: Callable[[bytes], Any],
    encode: Callable[[Any], bytes | Pieces],
    *,
    enveloped: bool = False,
) -> Method:
    return Method(decode, encode, handler, enveloped=enveloped)


def client_stream(
    fn: Callable[[AsyncIterator[Any]], Awaitable[Any]],
    decode: Callable[[bytes], Any],
    encode: Callable[[Any], bytes],
) -> Method:
    async def handler(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
        yield await fn(requests)

    return Method(decode, encode, handler)


def unary(
    fn: Callable[[Any], Awaitable[Any]],
    decode: Callable[[bytes], Any],
    encode: Callable[[Any], bytes],
    *,
    open: bool = False,
) -> Method:
    async def handler(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
        request = None
        async for message in requests:
            if request is not None:
                raise RpcError(INVALID_ARGUMENT, "a unary call sent more than one message")
            request = message
        if request is None:
            raise RpcError(INVALID_ARGUMENT, "a unary call sent no message")
        yield await fn(request)

    return Method(decode, encode, handler, open)


class RpcError(Exception):
    """Ends the call with `code` (a handler may raise it; the transport raises it too)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def envelope(payload: bytes) -> bytes:
    """One uncompressed gRPC message: flag, 4-byte length, bytes."""
    return _PREFIX.pack(0, len(payload)) + payload


def prefix(size: int) -> bytes:
    """The 5 bytes in front of an uncompressed gRPC message of `size` bytes."""
    return _PREFIX.pack(0, size)


def trailers(code: int, message: str | None = None) -> bytes:
    """The trailer block (HPACK literals) for grpc-status `code`."""
    block = literal(b"grpc-status", str(code).encode())
    if message:
        # grpc-message is percent-encoded (gRPC over HTTP/2, "Responses").
        block += literal(b"grpc-message", quote(message, safe=" ").encode())
    return block


# Bytes of reads a stream's unfinished message may keep alive beyond twice its own bytes.
PIN_SLACK = 1 << 20


class MessageReader:
    """Cuts a stream's DATA into gRPC messages; bytes of an unfinished message stay here.

    A large message arrives in many DATA frames (1 MiB is 64 of 16 KiB), handed over as views
    of the connection's reads. They are held as they come and each message is joined once,
    exactly its own bytes: that join is the transport's one copy of a message. (Copying each
    frame out of the read, joining whole frames, then cutting off the next message's start
    copied a large message three times: about 0.2 ms per 1 MiB body.)

    A view keeps its whole read alive, so a peer trickling one byte of a message per read
    (filling each read with DATA for another stream) would pin ~256 KiB per byte counted by
    flow control: when the reads held pin more than `2 x held + PIN_SLACK` bytes, the held
    bytes are copied out and the reads let go (a legitimate large message pins little more
    than itself, its reads being mostly its own frames)."""

    __slots__ = ("_have", "_need", "_parts", "_pinned", "max_bytes")

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._parts: list[bytes | memoryview] = []
        self._have = 0  # bytes in _parts
        self._need = -1  # the current message's size once its prefix is read, else -1
        self._pinned: dict[int, int] = {}  # id -> size of each read the held parts view

    def feed(self, data: bytes | memoryview) -> list[bytes]:
        """The messages `data` completes. `data` must not change afterwards (a view of a
        `bytes` read, never of a buffer that is reused): an unfinished message keeps it."""
        if not self._have and self._need < 0 and len(data) >= 5:
            # The common case: one DATA frame, one message.
            flag, size = _PREFIX.unpack_from(data)
            if size == len(data) - 5 and not flag:
                if size > self.max_bytes:
                    raise RpcError(RESOURCE_EXHAUSTED, f"message over {self.max_bytes} bytes")
                return [bytes(data[5:])]
        self._parts.append(data)
        self._have += len(data)
        out: list[bytes] = []
        while True:
            if self._need < 0:
                if self._have < 5:
                    break
                self._need = self._prefix()
            if self._have < self._need:
                break
            out.append(self._take(self._need))
            self._need = -1
        if out:
            self._pinned = {}
            for part in self._parts:
                self._pin(part)
        else:
            self._pin(data)
        if sum(self._pinned.values()) > 2 * self._have + PIN_SLACK:
            held = b"".join(self._parts)  # copy the held bytes out; the reads are let go
            self._parts = [held]
            self._pinned = {id(held): len(held)}
        return out

    def _pin(self, part: bytes | memoryview) -> None:
        read = part.obj if isinstance(part, memoryview) else part
        if isinstance(read, (bytes, bytearray, memoryview)):
            self._pinned[id(read)] = len(read)  # alive while a held part views it

    def _prefix(self) -> int:
        """Read the next message's 5-byte prefix off the held bytes; its size."""
        head = self._take(5)
        flag, size = _PREFIX.unpack_from(head)
        if flag:
            raise RpcError(UNIMPLEMENTED, "compressed messages are not accepted")
        if size > self.max_bytes:
            raise RpcError(RESOURCE_EXHAUSTED, f"message over {self.max_bytes} bytes")
        return int(size)

    def _take(self, n: int) -> bytes:
        """The first `n` held bytes (there are that many) as one `bytes`; the rest stays."""
        parts = self._parts
        taken: list[bytes | memoryview] = []
        got = used = 0
        while got < n:
            part = parts[used]
            room = n - got
            if len(part) > room:
                view = memoryview(part)
                taken.append(view[:room])
                parts[used] = view[room:]
                got = n
                break
            taken.append(part)
            got += len(part)
            used += 1
        del parts[:used]
        self._have -= n
        if len(taken) == 1 and isinstance(taken[0], bytes):
            return taken[0]
        return b"".join(taken)


class Inbox:
    """A stream's requests, as the handler's async iterator. The connection puts raw messages
    in (`put`, `end`, `fail`); decoding happens as the handler reads them, so a bad message is
    the handler's error (grpc-status INTERNAL), as with grpcio."""

    __slots__ = (
        "_decode", "_done", "_error", "_on_read", "_on_wait", "_queue", "_waiter", "queued",
    )  # fmt: skip

    def __init__(
        self,
        decode: Callable[[bytes], Any],
        on_read: Callable[[int], None],
        on_wait: Callable[[], None] | None = None,
    ) -> None:
        self._decode = decode
        self._on_read = on_read  # bytes read: the connection credits the window
        self._on_wait = on_wait  # the handler is about to wait for input: its replies go now
        self._queue: deque[bytes] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._done = False
        self._error: BaseException | None = None
        self.queued = 0  # bytes put and not yet read

    def put(self, message: bytes) -> None:
        self._queue.append(message)
        self.queued += len(message)
        self._wake()

    def end(self) -> None:
        self._done = True
        self._wake()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def __aiter__(self) -> Inbox:
        return self

    async def __anext__(self) -> Any:
        while True:
            if self._error is not None:
                raise self._error
            if self._queue:
                message = self._queue.popleft()
                self.queued -= len(message)
                self._on_read(len(message))
                return self._decode(message)
            if self._done:
                raise StopAsyncIteration
            if self._on_wait is not None:
                self._on_wait()
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
