"""One HTTP/2 connection of the lean transport: frames in, a task per gRPC stream, frames out.

Only what a gRPC server needs from HTTP/2 is here: no server push, no priorities, requests are
POSTs. What it does keep exactly is flow control in both directions, the HPACK decoder's state
(every header block is decoded in order, even a refused stream's) and the limits of `Limits`.
Frames queue in `_out` and go out in one write when a handler's step ends (it finished, or
waits for input or for the socket), or else at the end of the loop pass. Not only once per pass:
when a burst of streams arrives in one read, one pass runs every handler's routing, and a reply
held back for the pass would wait for the routing of all the others in the burst.

The connection is three layers, one class: `sender.Sender` (frames out, windows for our
DATA, ending), `receiver.Receiver` (frames in, our windows, header blocks), and `Connection`
here (the transport's callbacks, cutting reads into frames, opening a stream and running its
handler). `shared.Shared` is what all connections of a server share, `stream.Stream` one
stream's state.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator, Iterable
from typing import Any, cast

from poolkeeper.extproc.h2 import frames as f
from poolkeeper.extproc.h2.receiver import Receiver
from poolkeeper.extproc.h2.rpc import (
    INTERNAL,
    OK,
    UNAUTHENTICATED,
    UNIMPLEMENTED,
    Inbox,
    Method,
    RpcError,
    envelope,
)
from poolkeeper.extproc.h2.shared import Shared
from poolkeeper.extproc.h2.stream import Stream

log = logging.getLogger("poolkeeper.extproc.h2")

_HIGH_WATER = 1 << 20  # a stream's unsent reply bytes above which its handler waits
# A reply this large is written at once, not at the end of the handler's step: a body sent
# back in 62 KB pieces (streamed body mutations) then reaches Envoy, and goes on upstream,
# while the next pieces are encoded, rather than all of it after the last (a 1 MiB body held
# back ~3 ms of encoding on the EPP's thread). Small replies still leave together.
_EAGER_BYTES = 16 << 10


class Connection(Receiver):
    def __init__(self, shared: Shared) -> None:
        super().__init__(shared)
        self._buf = bytearray()
        self._preface = False
        self._unauthenticated = 0
        self._preface_timer: asyncio.TimerHandle | None = None

    # -- transport callbacks --------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's is not an asyncio.Transport subclass, only its shape).
        self.transport = transport = cast(asyncio.Transport, transport)
        shared = self.shared
        if shared.draining or len(shared.connections) >= self.limits.max_connections:
            self._closed = True
            transport.abort()
            if not shared.draining:
                shared.refused_connection(self.loop)
            return
        # uvloop's `writelines` is one writev that pauses the protocol as `write` does. The
        # standard loop's is `write(b"".join(...))` on 3.11, and on some 3.12 releases it
        # skipped the pause (backpressure): there, large replies are joined here instead.
        self._writev = type(transport).__module__.startswith("uvloop")
        tls = transport.get_extra_info("ssl_object")
        if tls is not None and tls.selected_alpn_protocol() != "h2":
            self._closed = True  # HTTP/2 over TLS needs ALPN h2 (RFC 9113 section 3.2)
            transport.abort()
            return
        shared.connections.add(self)
        shared.idle.clear()
        shared.stats.connections += 1
        shared.stats.open_connections += 1
        limits = self.limits
        self._write(
            f.settings(
                {
                    f.ENABLE_PUSH: 0,
                    f.MAX_CONCURRENT_STREAMS: limits.max_concurrent_streams,
                    f.INITIAL_WINDOW_SIZE: limits.stream_window,
                    f.MAX_HEADER_LIST_SIZE: limits.max_header_list_bytes,
                }
            )
        )
        if limits.connection_window > f.DEFAULT_WINDOW:
            self._write(f.window_update(0, limits.connection_window - f.DEFAULT_WINDOW))
        self._preface_timer = self.loop.call_later(limits.preface_timeout_s, self._no_preface)

    def connection_lost(self, exc: Exception | None) -> None:
        if self in self.shared.connections:
            self.shared.connections.discard(self)
            self.shared.stats.open_connections -= 1
            if not self.shared.connections:
                self.shared.idle.set()
        self._closed = True
        if self._preface_timer is not None:
            self._preface_timer.cancel()
        for stream in list(self._streams.values()):
            self._forget(stream)
            if stream.task is not None:
                stream.task.cancel()
        self._wake_writers()

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._wake_writers()

    def data_received(self, data: bytes) -> None:
        if self._closed:
            return
        if type(data) is not bytes:  # frames below keep views of it: it must never change
            data = bytes(data)
        try:
            pos = self._held(data) if self._buf or not self._preface else 0
            if pos >= 0:
                pos = self._frames(data, pos)
        except f.ProtocolViolation as error:
            self._fail(error.code, str(error))
            return
        if 0 <= pos < len(data) and not self._closed:
            self._buf += memoryview(data)[pos:]  # a frame cut off: held for the next read

    def _held(self, data: bytes) -> int:
        """Finish what an earlier read left unfinished (the preface, or a frame it cut off)
        with the start of `data`, and handle that frame alone: the rest of `data` is read
        where it lies, not copied behind the held bytes (a 1 MiB body comes in ~5 reads, each
        cutting a frame). Returns where in `data` the next frame starts, -1 if all of it is
        held (or the connection ended)."""
        buf = self._buf
        if not self._preface:
            buf += data
            if len(buf) < len(f.PREFACE):
                if not f.PREFACE.startswith(bytes(buf)):
                    self._abort()
                return -1
            if buf[: len(f.PREFACE)] != f.PREFACE:
                self._abort()
                return -1
            del buf[: len(f.PREFACE)]
            self._preface = True
            if self._preface_timer is not None:
                self._preface_timer.cancel()
            rest = bytes(buf)  # the connection's first read: copied once
            buf.clear()
            pos = self._frames(rest, 0)
            if pos < len(rest) and not self._closed:
                buf += memoryview(rest)[pos:]
            return -1
        at = 0
        if len(buf) < f.HEADER_LEN:
            at = min(f.HEADER_LEN - len(buf), len(data))
            buf += memoryview(data)[:at]
            if len(buf) < f.HEADER_LEN:
                return -1
        length = (buf[0] << 16) | (buf[1] << 8) | buf[2]
        if length <= f.DEFAULT_MAX_FRAME:  # a larger one is refused by `_frames` at once
            more = min(f.HEADER_LEN + length - len(buf), len(data) - at)
            buf += memoryview(data)[at : at + more]
            at += more
            if len(buf) < f.HEADER_LEN + length:
                return -1
        frame = bytes(buf)
        buf.clear()
        self._frames(frame, 0)
        return -1 if self._closed else at

    def _frames(self, data: bytes, pos: int) -> int:
        """Handle every whole frame of `data` from `pos` on; where the first unfinished one
        starts. DATA payloads go on as views of `data` (the message reader copies each
        message once), the other frames' as bytes (small, and parsed at once)."""
        size = len(data)
        view = memoryview(data)
        while size - pos >= f.HEADER_LEN:
            length, kind, flags, stream_id = f.parse_head(data, pos)
            if length > f.DEFAULT_MAX_FRAME:  # we never advertise a larger one
                raise f.ProtocolViolation(f.FRAME_SIZE_ERROR, "frame over the maximum size")
            start = pos + f.HEADER_LEN
            end = start + length
            if end > size:
                break
            pos = end
            if kind == f.DATA and self._cont is None:
                self._on_data(flags, stream_id, view[start:end])
            else:
                self._frame(kind, flags, stream_id, data[start:end])
            if self._closed:
                return size
        return pos

    def _open(self, stream_id: int, end_stream: bool, headers: Iterable[Any]) -> None:
        shared, stats = self.shared, self.shared.stats
        stats.streams += 1
        self._control.earn(self.limits.control_per_stream)
        if self._going_away or len(self._streams) >= self.limits.max_concurrent_streams:
            stats.refused_streams += 1
            self._write(f.rst_stream(stream_id, f.REFUSED_STREAM))
            return
        path = b""
        token: bytes | None = None
        for name, value in headers:
            if name == b":path":
                path = value
            elif name == shared.token_header:
                token = value
        method = shared.methods.get(path)
        if method is None:
            self._answer(stream_id, end_stream, UNIMPLEMENTED, "unknown method")
            return
        if not (method.open or self._allowed(token)):
            stats.unauthenticated += 1
            self._unauthenticated += 1
            self._answer(stream_id, end_stream, UNAUTHENTICATED, "only the gateway's Envoy")
            if self._unauthenticated > self.limits.max_unauthenticated:
                self._fail(f.ENHANCE_YOUR_CALM, "unauthenticated")
            return
        stream = Stream(
            stream_id, self._peer_stream_window, self.limits.stream_window,
            self.limits.max_message_bytes,
        )  # fmt: skip
        stream.inbox = Inbox(method.decode, lambda n: self._read(stream, n), self.flush_now)
        if end_stream:
            stream.remote_closed = True
            stream.inbox.end()
        self._streams[stream_id] = stream
        stats.active_streams += 1
        stream.task = self.loop.create_task(self._run(stream, method))

    def _allowed(self, token: bytes | None) -> bool:
        expected = self.shared.token
        if expected is None:
            return True
        return token is not None and secrets.compare_digest(token, expected)

    # -- the stream's handler -------------------------------------------------------------
    async def _run(self, stream: Stream, method: Method) -> None:
        assert stream.inbox is not None
        replies: AsyncIterator[Any] = method.handler(stream.inbox)
        try:
            async for reply in replies:
                data = method.encode(reply)
                if isinstance(data, tuple):  # an enveloped message in pieces
                    size = self._send_pieces(stream, data)
                else:
                    if not method.enveloped:
                        data = envelope(data)
                    self._send(stream, data)
                    size = len(data)
                if size >= _EAGER_BYTES:
                    self._flush_large()
                if self._paused or stream.pending_bytes > _HIGH_WATER:
                    await self._writable(stream)
            self._finish(stream, OK, None)
        except RpcError as error:
            self._finish(stream, error.code, error.message)
        except asyncio.CancelledError:
            raise  # the peer reset the stream or the connection ended: nothing to answer
        except Exception:
            log.exception("ext_proc transport: a handler failed on stream %d", stream.id)
            self.shared.stats.handler_errors += 1
            self._finish(stream, INTERNAL, "handler error")
        finally:
            self.flush_now()
            aclose = getattr(replies, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _writable(self, stream: Stream) -> None:
        self.flush_now()
        while (self._paused or stream.pending_bytes > _HIGH_WATER) and not self._closed:
            waiter = self.loop.create_future()
            self._writers.append(waiter)
            await waiter

    def _no_preface(self) -> None:
        if not self._preface:
            self._fail(f.PROTOCOL_ERROR, "no client preface in time")
