"""One HTTP/2 connection of the lean transport: frames in, a task per gRPC stream, frames out.

Only what a gRPC server needs from HTTP/2 is here: no server push, no priorities, requests are
POSTs. What it does keep exactly is flow control in both directions, the HPACK decoder's state
(every header block is decoded in order, even a refused stream's) and the limits of `Limits`.
Frames queue in `_out` and go out in one write when a handler's step ends (it finished, or
waits for input or for the socket), or else at the end of the loop pass. Not only once per pass:
when a burst of streams arrives in one read, one pass runs every handler's routing, and a reply
held back for the pass would wait for the routing of all the others in the burst.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections import deque
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any, cast

from poolkeeper.extproc.auth import TOKEN_HEADER
from poolkeeper.extproc.h2 import frames as f
from poolkeeper.extproc.h2.headers import HeaderDecoder
from poolkeeper.extproc.h2.limits import Bucket, Limits, TransportStats
from poolkeeper.extproc.h2.rpc import (
    INTERNAL,
    OK,
    UNAUTHENTICATED,
    UNIMPLEMENTED,
    Inbox,
    MessageReader,
    Method,
    Pieces,
    RpcError,
    envelope,
    trailers,
)

log = logging.getLogger("poolkeeper.extproc.h2")

_HIGH_WATER = 1 << 20  # a stream's unsent reply bytes above which its handler waits
# A reply this large is written at once, not at the end of the handler's step: a body sent
# back in 62 KB pieces (streamed body mutations) then reaches Envoy, and goes on upstream,
# while the next pieces are encoded, rather than all of it after the last (a 1 MiB body held
# back ~3 ms of encoding on the EPP's thread). Small replies still leave together.
_EAGER_BYTES = 16 << 10
REFUSAL_LOG_EVERY_S = 10.0  # connections closed over the limit: one warning at most this often


@dataclass(slots=True)
class Shared:
    """What every connection of one server shares."""

    methods: dict[bytes, Method]
    limits: Limits
    stats: TransportStats
    token: bytes | None = None  # required in `token_header` on every call but open ones
    token_header: bytes = TOKEN_HEADER.encode()  # the one grpcio's EnvoyOnly checks
    connections: set[Connection] = field(default_factory=set)
    draining: bool = False
    idle: asyncio.Event = field(default_factory=asyncio.Event)  # set when none is open
    refusals_logged: int = 0  # `stats.refused_connections` at the last warning
    refusal_logged_at: float = float("-inf")  # the loop's clock at that warning
    refusal_tail: asyncio.TimerHandle | None = None  # the warning for those since, when due

    def refused_connection(self, loop: asyncio.AbstractEventLoop) -> None:
        """Count a connection closed on accept over `max_connections`, and say so at most
        every REFUSAL_LOG_EVERY_S (a flood of them must not flood the log); those refused
        after a warning are told when the interval is over, not at the next refusal."""
        self.stats.refused_connections += 1
        due = self.refusal_logged_at + REFUSAL_LOG_EVERY_S
        now = loop.time()
        if now >= due:
            self._warn_refusals(now)
        elif self.refusal_tail is None:
            self.refusal_tail = loop.call_at(due, lambda: self._warn_refusals(loop.time()))

    def flush_refusals(self, now: float) -> None:
        """Tell the refusals not yet told now (the server stops)."""
        if self.refusal_tail is not None:
            self._warn_refusals(now)

    def _warn_refusals(self, now: float) -> None:
        if self.refusal_tail is not None:
            self.refusal_tail.cancel()
            self.refusal_tail = None
        log.warning(
            "closed %d ext_proc connection(s) on accept: %d were open (the limit)",
            self.stats.refused_connections - self.refusals_logged,
            self.limits.max_connections,
        )
        self.refusals_logged = self.stats.refused_connections
        self.refusal_logged_at = now


class Stream:
    __slots__ = (
        "deferred",
        "headers_sent",
        "id",
        "inbox",
        "pending",
        "pending_bytes",
        "reader",
        "recv_window",
        "remote_closed",
        "send_window",
        "task",
        "trailer",
        "unacked",
    )

    def __init__(self, stream_id: int, send_window: int, recv_window: int, max_msg: int) -> None:
        self.id = stream_id
        self.send_window = send_window
        self.recv_window = recv_window
        self.unacked = 0  # received bytes not yet credited back
        self.deferred = 0  # credit held back until the handler reads (backpressure)
        self.reader = MessageReader(max_msg)
        self.inbox: Inbox | None = None
        self.task: asyncio.Task[None] | None = None
        self.pending: deque[bytes | memoryview] = deque()  # reply bytes waiting for window
        self.pending_bytes = 0
        self.trailer: bytes | None = None  # to send once `pending` is out
        self.headers_sent = False
        self.remote_closed = False


class Connection(asyncio.Protocol):
    def __init__(self, shared: Shared) -> None:
        self.shared = shared
        self.limits = limits = shared.limits
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._preface = False
        self._closed = False
        self._out: list[bytes | memoryview] = []
        self._flush_pending = False
        self._paused = False
        self._writers: list[asyncio.Future[None]] = []
        self._decoder = HeaderDecoder(limits.max_header_list_bytes)
        self._streams: dict[int, Stream] = {}
        self._last_id = 0  # highest stream id the peer opened
        self._cont: tuple[int, bool, list[bytes], int, int] | None = None  # HEADERS in parts
        self._send_window = f.DEFAULT_WINDOW  # the peer's connection window for our DATA
        self._peer_stream_window = f.DEFAULT_WINDOW
        self._peer_max_frame = f.DEFAULT_MAX_FRAME
        self._recv_window = limits.connection_window
        self._recv_unacked = 0
        self._blocked: set[Stream] = set()  # streams with replies waiting for window
        self._going_away = False  # GOAWAY sent or received: no new streams, close when idle
        self._unauthenticated = 0
        now = self.loop.time()
        self._control = Bucket(limits.control_burst, limits.control_per_s, now)
        self._resets = Bucket(limits.reset_burst, limits.reset_per_s, now)
        self._preface_timer: asyncio.TimerHandle | None = None
        self._writev = False  # the transport writes views itself (`_flush_large`)

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

    # -- frames in ------------------------------------------------------------------------
    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self._cont is not None and kind != f.CONTINUATION:
            raise f.ProtocolViolation(f.PROTOCOL_ERROR, "expected CONTINUATION")
        if kind == f.DATA:  # (`_frames` hands DATA to `_on_data` itself)
            self._on_data(flags, stream_id, memoryview(payload))
        elif kind == f.HEADERS:
            self._on_headers(flags, stream_id, payload)
        elif kind == f.CONTINUATION:
            self._on_continuation(flags, stream_id, payload)
        else:
            if not self._control.take(self.loop.time()):
                raise f.ProtocolViolation(f.ENHANCE_YOUR_CALM, "too many control frames")
            if kind == f.RST_STREAM:
                self._on_rst(stream_id, payload)
            elif kind == f.WINDOW_UPDATE:
                self._on_window_update(stream_id, payload)
            elif kind == f.SETTINGS:
                self._on_settings(flags, stream_id, payload)
            elif kind == f.PING:
                if len(payload) != 8:
                    raise f.ProtocolViolation(f.FRAME_SIZE_ERROR, "PING of the wrong size")
                if stream_id:
                    raise f.ProtocolViolation(f.PROTOCOL_ERROR, "PING on a stream")
                if not flags & f.ACK:
                    self._control_reply(f.frame(f.PING, f.ACK, 0, payload))
            elif kind == f.GOAWAY:
                if stream_id or len(payload) < 8:
                    raise f.ProtocolViolation(f.PROTOCOL_ERROR, "malformed GOAWAY")
                self._going_away = True
                self._close_if_idle()
            elif kind == f.PRIORITY:
                if not stream_id or len(payload) != 5:
                    raise f.ProtocolViolation(f.PROTOCOL_ERROR, "malformed PRIORITY")
            elif kind == f.PUSH_PROMISE:
                raise f.ProtocolViolation(f.PROTOCOL_ERROR, "PUSH_PROMISE from a client")
            # Unknown frame types are ignored (RFC 9113 section 5.5), at a control frame's cost.

    def _on_data(self, flags: int, stream_id: int, payload: memoryview) -> None:
        if not stream_id:
            raise f.ProtocolViolation(f.PROTOCOL_ERROR, "DATA on stream 0")
        n = len(payload)  # padding counts against the windows too
        self._recv_window -= n
        if self._recv_window < 0:
            raise f.ProtocolViolation(f.FLOW_CONTROL_ERROR, "connection window exceeded")
        self._recv_unacked += n
        if self._recv_unacked >= self.limits.connection_window >> 2:
            self._write(f.window_update(0, self._recv_unacked))
            self._recv_window += self._recv_unacked
            self._recv_unacked = 0
        data = f.strip_padding(flags, payload)
        if not data and not flags & f.END_STREAM and not self._control.take(self.loop.time()):
            raise f.ProtocolViolation(f.ENHANCE_YOUR_CALM, "too many empty DATA frames")
        stream = self._streams.get(stream_id)
        if stream is None:
            if stream_id > self._last_id:
                raise f.ProtocolViolation(f.PROTOCOL_ERROR, "DATA on an idle stream")
            return  # a stream already answered or reset: its late data is dropped
        if stream.remote_closed:
            self._reset(stream, f.STREAM_CLOSED)
            return
        stream.recv_window -= n
        if stream.recv_window < 0:
            self._reset(stream, f.FLOW_CONTROL_ERROR)
            return
        assert stream.inbox is not None
        if stream.inbox.queued > self.limits.stream_window >> 1:
            stream.deferred += n  # the handler is behind: Envoy waits for it
        else:
            self._credit(stream, n)
        if data:
            try:
                messages = stream.reader.feed(data)
            except RpcError as error:
                self._reject(stream, error)
                return
            for message in messages:
                stream.inbox.put(message)
        if flags & f.END_STREAM:
            stream.remote_closed = True
            stream.inbox.end()

    def _credit(self, stream: Stream, n: int) -> None:
        stream.unacked += n
        if stream.unacked >= self.limits.stream_window >> 2:
            self._write(f.window_update(stream.id, stream.unacked))
            stream.recv_window += stream.unacked
            stream.unacked = 0

    def _read(self, stream: Stream, n: int) -> None:
        """The handler read a message: held-back credit goes out once it has caught up."""
        inbox = stream.inbox
        if not stream.deferred or inbox is None or self._closed:
            return
        if inbox.queued <= self.limits.stream_window >> 1:
            owed, stream.deferred = stream.deferred, 0
            self._credit(stream, owed)

    def _on_headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        if not stream_id or not stream_id & 1:
            raise f.ProtocolViolation(f.PROTOCOL_ERROR, "HEADERS on an even stream id")
        block = f.strip_padding(flags, payload)
        if flags & f.PRIORITY_FLAG:
            if len(block) < 5:
                raise f.ProtocolViolation(f.PROTOCOL_ERROR, "HEADERS priority too short")
            block = block[5:]
        if len(block) > self.limits.max_header_block_bytes:
            raise f.ProtocolViolation(f.ENHANCE_YOUR_CALM, "header block too large")
        end_stream = bool(flags & f.END_STREAM)
        if flags & f.END_HEADERS:
            self._headers(stream_id, end_stream, block)
        else:
            self._cont = (stream_id, end_stream, [block], len(block), 0)

    def _on_continuation(self, flags: int, stream_id: int, payload: bytes) -> None:
        if self._cont is None or self._cont[0] != stream_id:
            raise f.ProtocolViolation(f.PROTOCOL_ERROR, "CONTINUATION out of place")
        sid, end_stream, parts, size, count = self._cont
        size += len(payload)
        count += 1
        if size > self.limits.max_header_block_bytes:
            raise f.ProtocolViolation(f.ENHANCE_YOUR_CALM, "header block too large")
        if count > self.limits.max_continuation_frames:
            raise f.ProtocolViolation(f.ENHANCE_YOUR_CALM, "too many CONTINUATION frames")
        parts.append(payload)
        if flags & f.END_HEADERS:
            self._cont = None
            self._headers(sid, end_stream, b"".join(parts))
        else:
            self._cont = (sid, end_stream, parts, size, count)

    def _headers(self, stream_id: int, end_stream: bool, block: bytes) -> None:
        try:
            headers = self._decoder.decode(block)
        except Exception as error:  # hpack's errors, or a malformed block it chokes on
            raise f.ProtocolViolation(f.COMPRESSION_ERROR, f"header block: {error}") from None
        stream = self._streams.get(stream_id)
        if stream is not None:  # trailers from the client end its side
            if not end_stream:
                raise f.ProtocolViolation(f.PROTOCOL_ERROR, "second HEADERS without END_STREAM")
            if not stream.remote_closed and stream.inbox is not None:
                stream.remote_closed = True
                stream.inbox.end()
            return
        if stream_id <= self._last_id:
            return  # a stream already answered: decoded only to keep HPACK's table in step
        self._last_id = stream_id
        self._open(stream_id, end_stream, headers)

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

    def _on_rst(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise f.ProtocolViolation(f.FRAME_SIZE_ERROR, "RST_STREAM of the wrong size")
        if not stream_id or stream_id > self._last_id:
            raise f.ProtocolViolation(f.PROTOCOL_ERROR, "RST_STREAM on an idle stream")
        stream = self._streams.get(stream_id)
        if stream is None:
            return  # Envoy's reset after our trailers: nothing left to do
        running = stream.task is not None and not stream.task.done()
        self._forget(stream)
        if running:
            assert stream.task is not None
            stream.task.cancel()
            self.shared.stats.premature_resets += 1
            if not self._resets.take(self.loop.time()):
                raise f.ProtocolViolation(f.ENHANCE_YOUR_CALM, "too many stream resets")

    def _on_window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise f.ProtocolViolation(f.FRAME_SIZE_ERROR, "WINDOW_UPDATE of the wrong size")
        increment = f.u32(payload) & 0x7FFFFFFF
        if not stream_id:
            if not increment:
                raise f.ProtocolViolation(f.PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            self._send_window += increment
            if self._send_window > f.MAX_WINDOW:
                raise f.ProtocolViolation(f.FLOW_CONTROL_ERROR, "connection window overflow")
            for blocked in list(self._blocked):
                self._push(blocked)
            return
        stream = self._streams.get(stream_id)
        if stream is None:
            if stream_id > self._last_id:
                raise f.ProtocolViolation(f.PROTOCOL_ERROR, "WINDOW_UPDATE on an idle stream")
            return
        if not increment or stream.send_window + increment > f.MAX_WINDOW:
            self._reset(stream, f.PROTOCOL_ERROR if not increment else f.FLOW_CONTROL_ERROR)
            return
        stream.send_window += increment
        self._push(stream)

    def _on_settings(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id:
            raise f.ProtocolViolation(f.PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & f.ACK:
            if payload:
                raise f.ProtocolViolation(f.FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
            return
        for key, value in f.parse_settings(payload):
            if key == f.INITIAL_WINDOW_SIZE:
                if value > f.MAX_WINDOW:
                    raise f.ProtocolViolation(f.FLOW_CONTROL_ERROR, "initial window too large")
                delta, self._peer_stream_window = value - self._peer_stream_window, value
                for stream in self._streams.values():
                    stream.send_window += delta
            elif key == f.MAX_FRAME_SIZE:
                if not f.DEFAULT_MAX_FRAME <= value <= (1 << 24) - 1:
                    raise f.ProtocolViolation(f.PROTOCOL_ERROR, "MAX_FRAME_SIZE out of range")
                self._peer_max_frame = value
            elif key == f.ENABLE_PUSH and value > 1:
                raise f.ProtocolViolation(f.PROTOCOL_ERROR, "ENABLE_PUSH not 0 or 1")
            # HEADER_TABLE_SIZE: our blocks never use the dynamic table; others are advisory.
        self._control_reply(f.SETTINGS_ACK)
        for stream in list(self._streams.values()):
            if stream.pending:
                self._push(stream)

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

    def _wake_writers(self) -> None:
        writers, self._writers = self._writers, []
        for waiter in writers:
            if not waiter.done():
                waiter.set_result(None)

    # -- frames out -----------------------------------------------------------------------
    def _write(self, data: bytes | memoryview) -> None:
        self._out.append(data)
        if not self._flush_pending:
            self._flush_pending = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_pending = False
        if self._out and not self._closed and self.transport is not None:
            self.transport.write(b"".join(self._out))
        self._out.clear()

    def flush_now(self) -> None:
        """Write what is queued now (a handler's step ended); the pass's flush stays scheduled
        for whatever comes later in the pass."""
        if self._out and not self._closed and self.transport is not None:
            self.transport.write(b"".join(self._out))
            self._out.clear()

    def _flush_large(self) -> None:
        """`flush_now` for a large reply: its frames' payloads are views of it, handed to the
        transport as they are (uvloop writes them with one writev), not joined into a copy;
        on other loops, joined (`connection_made`)."""
        if self._out and not self._closed and self.transport is not None:
            if self._writev:
                self.transport.writelines(self._out)
            else:
                self.transport.write(b"".join(self._out))
            self._out.clear()

    def _control_reply(self, data: bytes) -> None:
        assert self.transport is not None
        backlog = self.transport.get_write_buffer_size() + sum(map(len, self._out))
        if backlog > self.limits.max_write_backlog:
            raise f.ProtocolViolation(f.ENHANCE_YOUR_CALM, "the peer does not read")
        self._write(data)

    def _send(self, stream: Stream, data: bytes) -> None:
        if stream.id not in self._streams:
            return  # reset meanwhile
        if not stream.headers_sent:
            stream.headers_sent = True
            self._write(f.frame(f.HEADERS, f.END_HEADERS, stream.id, f.RESPONSE_HEADERS))
        n = len(data)
        if (
            not stream.pending
            and n <= stream.send_window
            and n <= self._send_window
            and n <= self._peer_max_frame
        ):
            stream.send_window -= n
            self._send_window -= n
            self._write(f.frame(f.DATA, 0, stream.id, data))
            return
        stream.pending.append(data)
        stream.pending_bytes += n
        self._push(stream)

    def _send_pieces(self, stream: Stream, pieces: Pieces) -> int:
        """`_send` for a message in pieces: the same frames as for its joined bytes, each
        payload written as views of the pieces (a 1 MiB body's replies are not copied before
        the socket). Where the windows hold it back, joined after all (rare: Envoy's windows
        are large). Returns the message's size."""
        total = n = sum(map(len, pieces))
        if stream.pending or n > stream.send_window or n > self._send_window:
            self._send(stream, b"".join(pieces))
            return total
        if stream.id not in self._streams:
            return total  # reset meanwhile
        if not stream.headers_sent:
            stream.headers_sent = True
            self._write(f.frame(f.HEADERS, f.END_HEADERS, stream.id, f.RESPONSE_HEADERS))
        stream.send_window -= n
        self._send_window -= n
        write, limit, sid = self._write, self._peer_max_frame, stream.id
        room = 0  # payload bytes the current frame still takes
        for piece in pieces:
            size, at = len(piece), 0
            while at < size:
                if not room:
                    room = min(limit, n)
                    n -= room
                    write(f.frame_head(f.DATA, 0, sid, room))
                take = min(room, size - at)
                write(piece if take == size else memoryview(piece)[at : at + take])
                at += take
                room -= take
        return total

    def _push(self, stream: Stream) -> None:
        """Send what the windows allow of `stream`'s waiting replies, then its trailers."""
        pending = stream.pending
        while pending:
            allowed = min(stream.send_window, self._send_window, self._peer_max_frame)
            if allowed <= 0:
                self._blocked.add(stream)
                return
            chunk = pending[0]
            if len(chunk) > allowed:
                # Views, not copies: a 62 KB reply is four frames, and slicing bytes copied
                # the rest of it at each cut. The payload is copied once, when written out.
                view = memoryview(chunk)
                pending[0] = view[allowed:]
                chunk = view[:allowed]
            else:
                pending.popleft()
            n = len(chunk)
            stream.pending_bytes -= n
            stream.send_window -= n
            self._send_window -= n
            self._write(f.frame_head(f.DATA, 0, stream.id, n))
            self._write(chunk)
        self._blocked.discard(stream)
        if stream.trailer is not None:
            self._write(f.frame(f.HEADERS, f.END_HEADERS | f.END_STREAM, stream.id, stream.trailer))
            stream.trailer = None
            self._forget(stream)
        if self._writers:
            self._wake_writers()

    def _finish(self, stream: Stream, code: int, message: str | None) -> None:
        if stream.id not in self._streams:
            return
        block = trailers(code, message[:512] if message else None)
        if not stream.headers_sent:
            block = f.RESPONSE_HEADERS + block  # trailers-only response
        stream.trailer = block
        self._push(stream)

    def _answer(self, stream_id: int, end_stream: bool, code: int, message: str) -> None:
        """A trailers-only answer for a stream that never gets a handler."""
        block = f.RESPONSE_HEADERS + trailers(code, message)
        self._write(f.frame(f.HEADERS, f.END_HEADERS | f.END_STREAM, stream_id, block))
        if not end_stream:  # the client need not send the rest
            self._write(f.rst_stream(stream_id, f.NO_ERROR))

    def _reject(self, stream: Stream, error: RpcError) -> None:
        """The stream's input broke a gRPC rule: answer with the status, stop the handler."""
        if stream.task is not None:
            stream.task.cancel()
        stream.pending.clear()
        stream.pending_bytes = 0
        self._finish(stream, error.code, error.message)
        if not stream.remote_closed:
            self._write(f.rst_stream(stream.id, f.NO_ERROR))

    def _reset(self, stream: Stream, code: int) -> None:
        self._write(f.rst_stream(stream.id, code))
        self._forget(stream)
        if stream.task is not None:
            stream.task.cancel()

    def _forget(self, stream: Stream) -> None:
        if self._streams.pop(stream.id, None) is not None:
            self.shared.stats.active_streams -= 1
        self._blocked.discard(stream)
        self._close_if_idle()

    # -- ending ---------------------------------------------------------------------------
    def goaway(self) -> None:
        """Graceful drain: streams open now finish, new ones are refused, then it closes."""
        if self._closed or self._going_away:
            return
        self._going_away = True
        self.shared.stats.goaway("drain")
        self._write(f.goaway(self._last_id, f.NO_ERROR))
        self._close_if_idle()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def active(self) -> int:
        return len(self._streams)

    def _close_if_idle(self) -> None:
        if self._going_away and not self._streams and not self._closed:
            self._flush()
            self._closed = True
            assert self.transport is not None
            self.transport.close()

    def _fail(self, code: int, why: str) -> None:
        if self._closed:
            return
        stats = self.shared.stats
        stats.goaway(f.ERROR_NAMES.get(code, "other"))
        failed = sum(stats.goaways.values())
        if failed == 1 or failed % 1000 == 0:  # never a line per hostile connection
            log.warning("ext_proc transport: closed a connection (%d so far): %s", failed, why)
        self._write(f.goaway(self._last_id, code, why.encode()[:128]))
        self._flush()
        self._closed = True
        transport = self.transport
        assert transport is not None
        # Half-close and drain what the peer still sends for a moment: closing a socket with
        # unread input resets it, and the reset can destroy the GOAWAY before it is read.
        if transport.can_write_eof():
            transport.write_eof()
            self.loop.call_later(1.0, transport.abort)
        else:
            transport.close()

    def _no_preface(self) -> None:
        if not self._preface:
            self._fail(f.PROTOCOL_ERROR, "no client preface in time")

    def _abort(self) -> None:
        self._closed = True
        if self.transport is not None:
            self.transport.abort()

    def close(self) -> None:
        """Hard stop (after drain): the handlers still running are cancelled."""
        if self.transport is not None and not self.transport.is_closing():
            self._flush()
            self._closed = True
            self.transport.close()
