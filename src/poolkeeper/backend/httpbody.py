"""The body half of the scrape client's HTTP/1.1 response parser, and the state both halves share.

`ResponseReader` holds a response's state (`__slots__`, set up in `__init__`) and reads its body:
delimited by Content-Length, by chunked coding (extensions and trailers skipped) or by the
connection's clean close, with the body cap checked as bytes arrive. `backend/httpparse.py`'s
`ResponseParser` is its subclass: it reads the head and drives the modes (`feed`, `feed_eof`).
One class through a base, as before: no method is wrapped and no attribute moved behind
another object.
"""

from __future__ import annotations

from typing import Final

_MAX_CHUNK_LINE: Final = 1024  # a chunk-size line with extensions; longer is an attack


class HttpResponseError(Exception):
    """A response that cannot be read; the message says why, precisely."""


class ResponseReader:
    """A response's state and its body's reading; `ResponseParser` reads the head."""

    __slots__ = (
        "_buf",
        "_chunk_left",
        "_chunks",
        "_length",
        "_max_body",
        "_max_header_bytes",
        "_max_headers",
        "_mode",
        "_scanned",
        "_size",
        "body",
        "headers",
        "keep_alive",
        "location",
        "reason",
        "received",
        "status",
    )

    def __init__(self, max_body: int, max_header_bytes: int = 64 * 1024, max_headers: int = 100):
        self._max_body = max_body
        self._max_header_bytes = max_header_bytes
        self._max_headers = max_headers
        self._buf = b""
        self._scanned = 0  # bytes of _buf searched for the head's end (not searched again)
        # head, length, eof, chunk-size, chunk-data, chunk-crlf, trailer, then done
        self._mode = "head"
        self._chunks: list[bytes] = []
        self._size = 0
        self._length = 0
        self._chunk_left = 0
        self.received = 0  # bytes fed so far (0 means the server sent nothing at all)
        self.status = 0
        self.reason = ""
        self.headers: dict[str, str] = {}
        self.location: str | None = None
        self.keep_alive = False
        self.body = b""

    @property
    def done(self) -> bool:
        """Whether the response is complete."""
        return self._mode == "done"

    def _take(self, data: bytes) -> None:
        self._size += len(data)
        if self._size > self._max_body:
            raise HttpResponseError(f"response exceeds the {self._max_body}-byte limit")
        self._chunks.append(data)

    def _body_bytes(self, buf: bytes) -> bytes:
        if self._mode == "eof":
            self._take(buf)
            return b""
        want = self._length - self._size
        self._take(buf[:want])
        if self._size == self._length:
            self._finish()
        return buf[want:]

    def _chunk_line(self, buf: bytes) -> bytes | None:
        end = buf.find(b"\r\n")
        if end < 0:
            if len(buf) > _MAX_CHUNK_LINE:
                raise HttpResponseError("chunk line too long")
            self._buf = buf
            return None
        if end > _MAX_CHUNK_LINE:
            raise HttpResponseError("chunk line too long")
        line, rest = buf[:end], buf[end + 2 :]
        mode = self._mode
        if mode == "chunk-crlf":
            if line:
                raise HttpResponseError("chunk not followed by CRLF")
            self._mode = "chunk-size"
        elif mode == "trailer":
            if not line:
                self._finish()
        else:
            size = line.split(b";", 1)[0].strip(b" \t")
            size = size.lstrip(b"0") or (b"0" if size else b"")
            if not size or len(size) > 15 or size.strip(b"0123456789abcdefABCDEF"):
                raise HttpResponseError(f"bad chunk size {show(line)}")
            self._chunk_left = int(size, 16)
            if self._size + self._chunk_left > self._max_body:
                raise HttpResponseError(f"response exceeds the {self._max_body}-byte limit")
            self._mode = "chunk-data" if self._chunk_left else "trailer"
        return rest

    def _chunk_data(self, buf: bytes) -> bytes:
        want = self._chunk_left
        piece = buf[:want]
        self._take(piece)
        self._chunk_left -= len(piece)
        if not self._chunk_left:
            self._mode = "chunk-crlf"
        return buf[want:]

    def _finish(self) -> None:
        chunks = self._chunks
        self.body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._chunks = []
        self._mode = "done"


def show(raw: bytes, limit: int = 40) -> str:
    """A short, printable rendering of bad input for an error message."""
    text = repr(raw[:limit])
    return text + ("..." if len(raw) > limit else "")
