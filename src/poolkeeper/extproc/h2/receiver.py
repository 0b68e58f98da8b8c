"""Frames in on a lean-transport connection, once cut from the bytes read.

`Receiver` is `connection.Connection`'s middle layer (on `sender.Sender`): each frame's
dispatch, the control-frame and reset budgets, our receive windows and the credit given back
(held back while a handler is behind), HEADERS and CONTINUATION into decoded header lists (the
HPACK decoder's state kept in order, even for a refused stream), RST_STREAM, WINDOW_UPDATE and
SETTINGS. Opening a stream is the connection's (`_open`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from poolkeeper.extproc.h2 import frames as f
from poolkeeper.extproc.h2.headers import HeaderDecoder
from poolkeeper.extproc.h2.limits import Bucket
from poolkeeper.extproc.h2.rpc import RpcError
from poolkeeper.extproc.h2.sender import Sender
from poolkeeper.extproc.h2.shared import Shared
from poolkeeper.extproc.h2.stream import Stream


class Receiver(Sender):
    def __init__(self, shared: Shared) -> None:
        super().__init__(shared)
        limits = self.limits
        self._decoder = HeaderDecoder(limits.max_header_list_bytes)
        self._cont: tuple[int, bool, list[bytes], int, int] | None = None  # HEADERS in parts
        self._peer_stream_window = f.DEFAULT_WINDOW
        self._recv_window = limits.connection_window
        self._recv_unacked = 0
        now = self.loop.time()
        self._control = Bucket(limits.control_burst, limits.control_per_s, now)
        self._resets = Bucket(limits.reset_burst, limits.reset_per_s, now)

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
        """A new stream's headers, decoded: the connection routes it to its handler."""
        raise NotImplementedError

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
