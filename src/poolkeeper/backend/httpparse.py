"""An incremental HTTP/1.1 response parser for metrics pages: bytes in, one response out.

Pure and synchronous (no I/O), so it can be fuzzed on its own; `backend/httpget.py` drives it
from an asyncio Protocol. It reads exactly what a scrape needs and refuses the rest with a
precise `HttpResponseError` message (which ends up in `EndpointMetrics.error`):

- a status line `HTTP/1.x NNN reason`; anything else is a garbage status line;
- at most `max_header_bytes` of head and `max_headers` header lines (no obsolete line folding,
  every line ended by CRLF: a bare LF is refused by name);
- a non-200 status ends the response at its head (redirects are reported, never followed);
- a body delimited by Content-Length, by chunked coding (extensions and trailers skipped), or
  by the connection's clean close (a reset is an error: the body may be cut anywhere); no
  other Transfer-Encoding and no Content-Encoding but identity (the request asks for
  identity: a compressed page is refused, never inflated);
- the body cap: a declared length over it is refused before reading, a streamed body as soon
  as it passes it.
"""

from __future__ import annotations

from typing import Final

from poolkeeper.backend.httpbody import HttpResponseError, ResponseReader, show

__all__ = ["HttpResponseError", "ResponseParser"]

_HEAD_END: Final = b"\r\n\r\n"


class ResponseParser(ResponseReader):
    """Feed bytes with `feed` until it returns True; then read `status`, `reason`, `body`."""

    __slots__ = ()  # the state is ResponseReader's

    def feed(self, data: bytes) -> bool:
        """Take the next bytes; True once the response is complete (later bytes are ignored,
        and the connection is then not reusable). Raises HttpResponseError."""
        if self.done:
            self.keep_alive = False  # bytes after a complete response: out of sync
            return True
        self.received += len(data)
        buf = self._buf + data if self._buf else data
        self._buf = b""
        while buf:
            mode = self._mode
            if mode == "done":  # bytes after the complete response: the connection is out of sync
                self.keep_alive = False
                break
            rest: bytes | None
            if mode == "head":
                rest = self._head(buf)
            elif mode == "length" or mode == "eof":
                rest = self._body_bytes(buf)
            elif mode == "chunk-data":
                rest = self._chunk_data(buf)
            else:
                rest = self._chunk_line(buf)
            if rest is None:
                return False  # waiting for more bytes (kept in _buf)
            buf = rest
        return self.done

    def feed_eof(self, lost: str | None = None) -> None:
        """The connection closed; completes a close-delimited body, else raises. `lost`: why
        the connection was lost when it did not close cleanly (a reset): then even a
        close-delimited body is incomplete, since only a clean close ends one."""
        if self.done:
            return
        if self._mode == "eof":
            if lost is not None:
                raise HttpResponseError(
                    f"connection lost after {self._size} bytes of a body delimited by the "
                    f"connection's close: {lost}"
                )
            self._finish()
            return
        if self.received == 0:
            raise HttpResponseError("connection closed before any response")
        if self._mode == "head":
            raise HttpResponseError(
                f"connection closed in the response head after {self.received} bytes"
            )
        raise HttpResponseError(
            f"connection closed after {self._size} bytes of the body"
            + (f" of {self._length}" if self._mode == "length" else "")
        )

    # -- the head --------------------------------------------------------------------------

    def _head(self, buf: bytes) -> bytes | None:
        # A head trickled in small reads is searched once, not again from its start per read.
        scanned = self._scanned
        end = buf.find(_HEAD_END, max(0, scanned - len(_HEAD_END) + 1))
        if end < 0:
            self._scanned = len(buf)
            if len(buf) > self._max_header_bytes:
                raise HttpResponseError(f"response head exceeds {self._max_header_bytes} bytes")
            if len(buf) >= 5 and not buf.startswith(b"HTTP/"):
                raise HttpResponseError(f"garbage status line {show(buf)}")
            _no_bare_lf(buf, scanned, len(buf))
            self._buf = buf
            return None
        self._scanned = 0
        if end > self._max_header_bytes:
            raise HttpResponseError(f"response head exceeds {self._max_header_bytes} bytes")
        _no_bare_lf(buf, scanned, end)
        lines = buf[:end].split(b"\r\n")
        self._status_line(lines[0])
        if len(lines) - 1 > self._max_headers:
            raise HttpResponseError(f"more than {self._max_headers} response headers")
        headers = self.headers
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep or not name or name != name.strip() or line[:1] in b" \t":
                raise HttpResponseError(f"malformed header line {show(line)}")
            key = name.decode("latin-1").lower()
            text = value.strip(b" \t").decode("latin-1")
            if key in ("content-length", "transfer-encoding") and headers.get(key, text) != text:
                raise HttpResponseError(f"conflicting {key} headers")
            headers[key] = text
        self._begin_body()
        return buf[end + 4 :]

    def _status_line(self, line: bytes) -> None:
        parts = line.split(b" ", 2)
        if (
            len(parts) < 2
            or parts[0] not in (b"HTTP/1.1", b"HTTP/1.0")
            or len(parts[1]) != 3
            or not parts[1].isdigit()
        ):
            raise HttpResponseError(f"garbage status line {show(line)}")
        self.status = int(parts[1])
        self.reason = parts[2].decode("latin-1").strip() if len(parts) == 3 else ""
        self.keep_alive = parts[0] == b"HTTP/1.1"

    def _begin_body(self) -> None:
        headers = self.headers
        connection = headers.get("connection", "").lower()
        if "close" in connection:
            self.keep_alive = False
        elif "keep-alive" in connection:
            self.keep_alive = True
        if self.status != 200:
            # Only a 200 page is read; the rest of this response is not, so the connection
            # cannot carry another request.
            if 100 <= self.status < 200 and self.status != 101:
                # An interim response (100 Continue, 103 Early Hints): the real one follows
                # (RFC 9110 section 15.2: a client must parse and skip it).
                self.headers = {}
                self.status, self.reason = 0, ""
                return
            if self.status == 101:
                raise HttpResponseError("unexpected protocol switch (HTTP 101)")
            self.location = headers.get("location")
            self.keep_alive = False
            self._finish()
            return
        encoding = headers.get("content-encoding", "identity").strip().lower()
        if encoding != "identity":
            raise HttpResponseError(f"unsupported Content-Encoding {encoding!r}")
        transfer = headers.get("transfer-encoding")
        declared = headers.get("content-length")
        if transfer is not None:
            if transfer.strip().lower() != "chunked":
                raise HttpResponseError(f"unsupported Transfer-Encoding {transfer!r}")
            if declared is not None:
                raise HttpResponseError("both Content-Length and Transfer-Encoding")
            self._mode = "chunk-size"
        elif declared is not None:
            digits = declared.lstrip("0") or "0"  # leading zeros are valid (aiohttp's too)
            # ASCII only: str.isdigit() also takes superscripts, which int() then refuses.
            if not (digits.isascii() and digits.isdigit()) or len(digits) > 18:
                raise HttpResponseError(f"bad Content-Length {declared!r}")
            length = int(digits)
            if length > self._max_body:
                raise HttpResponseError(
                    f"response of {length} bytes exceeds the {self._max_body}-byte limit"
                )
            self._length = length
            self._mode = "length"
            if length == 0:
                self._finish()
        else:
            self._mode = "eof"  # delimited by the server closing the connection
            self.keep_alive = False


def _no_bare_lf(head: bytes, start: int, stop: int) -> None:
    """Refuse a line ended by a bare LF in `head[start:stop]` (the bytes before `start` were
    checked already). RFC 9112 lets a client accept one, but a scrape target that sends one is
    broken or is not an HTTP server; refused by name rather than waited on: the head's end is
    CRLF CRLF, so such a head was never found and the error said the connection closed in it.
    Two counts in C, no loop: every LF in a valid head is the end of a CRLF."""
    if head.count(b"\n", start, stop) == head.count(b"\r\n", max(0, start - 1), stop):
        return
    at = head.find(b"\n", start, stop)
    while at > 0 and head[at - 1] == 0x0D:  # the first LF without its CR
        at = head.find(b"\n", at + 1, stop)
    line = head.rfind(b"\n", 0, max(0, at)) + 1  # the line it ends
    raise HttpResponseError(
        f"bare LF line ending (no CR) in the response head, line {show(head[line : at + 1])}"
    )
