"""Frames out of a lean-transport connection, and its end.

`Sender` is the base of `connection.Connection`: the write queue (`_out`) and its flushes,
the peer's windows for our DATA (connection and stream), replies and their trailers, resets,
the stream table's removals, and the ways a connection ends (GOAWAY and drain, a protocol
error, a hard close). Frames queue in `_out` and go out in one write when a handler's step
ends, or at the end of the loop pass (connection.py says why).
"""

from __future__ import annotations

import asyncio
import logging

from poolkeeper.extproc.h2 import frames as f
from poolkeeper.extproc.h2.rpc import Pieces, RpcError, trailers
from poolkeeper.extproc.h2.shared import Shared
from poolkeeper.extproc.h2.stream import Stream

log = logging.getLogger("poolkeeper.extproc.h2")


class Sender(asyncio.Protocol):
    def __init__(self, shared: Shared) -> None:
        self.shared = shared
        self.limits = shared.limits
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self._closed = False
        self._out: list[bytes | memoryview] = []
        self._flush_pending = False
        self._paused = False
        self._writers: list[asyncio.Future[None]] = []
        self._streams: dict[int, Stream] = {}
        self._last_id = 0  # highest stream id the peer opened
        self._send_window = f.DEFAULT_WINDOW  # the peer's connection window for our DATA
        self._peer_max_frame = f.DEFAULT_MAX_FRAME
        self._blocked: set[Stream] = set()  # streams with replies waiting for window
        self._going_away = False  # GOAWAY sent or received: no new streams, close when idle
        self._writev = False  # the transport writes views itself (`_flush_large`)

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
