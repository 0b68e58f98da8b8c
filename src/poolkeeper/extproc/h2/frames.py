"""HTTP/2 frames (RFC 9113): types, flags, error codes, the encoders the server needs, and the
stateless HPACK literals its header blocks use.

The server's own header blocks use only HPACK's static table and literals without indexing, so
they never touch the peer's dynamic table (nothing to keep in step, any table size works).
Decoding the peer's blocks is `hpack.Decoder`'s job (connection.py).
"""

from __future__ import annotations

import struct
from typing import overload

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HEADER_LEN = 9
DEFAULT_MAX_FRAME = 16_384
MAX_WINDOW = (1 << 31) - 1
DEFAULT_WINDOW = 65_535

# Frame types.
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS = 0x0, 0x1, 0x2, 0x3, 0x4
PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0x5, 0x6, 0x7, 0x8, 0x9

# Flags.
END_STREAM = 0x1
ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20

# Error codes.
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL = 0x5, 0x6, 0x7, 0x8
COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 0x9, 0xB

ERROR_NAMES = {
    NO_ERROR: "no_error", PROTOCOL_ERROR: "protocol_error", INTERNAL_ERROR: "internal_error",
    FLOW_CONTROL_ERROR: "flow_control_error", STREAM_CLOSED: "stream_closed",
    FRAME_SIZE_ERROR: "frame_size_error", REFUSED_STREAM: "refused_stream", CANCEL: "cancel",
    COMPRESSION_ERROR: "compression_error", ENHANCE_YOUR_CALM: "enhance_your_calm",
}  # fmt: skip

# Settings.
HEADER_TABLE_SIZE, ENABLE_PUSH, MAX_CONCURRENT_STREAMS = 0x1, 0x2, 0x3
INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE, MAX_HEADER_LIST_SIZE = 0x4, 0x5, 0x6

_HEAD = struct.Struct(">HBBBL")  # length as 16 + 8 bits, type, flags, stream id
_U32 = struct.Struct(">L")


class ProtocolViolation(Exception):
    """The peer broke the protocol: the connection ends with GOAWAY(`code`)."""

    def __init__(self, code: int, why: str) -> None:
        super().__init__(why)
        self.code = code


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return _HEAD.pack(n >> 8, n & 0xFF, kind, flags, stream_id) + payload


def frame_head(kind: int, flags: int, stream_id: int, length: int) -> bytes:
    """A frame header alone, for a payload written after it."""
    return _HEAD.pack(length >> 8, length & 0xFF, kind, flags, stream_id)


def parse_head(buf: bytes | bytearray | memoryview, at: int) -> tuple[int, int, int, int]:
    """(length, type, flags, stream id) of the frame header at `at`."""
    high, low, kind, flags, stream_id = _HEAD.unpack_from(buf, at)
    return (high << 8) | low, kind, flags, stream_id & 0x7FFFFFFF


def settings(values: dict[int, int]) -> bytes:
    return frame(SETTINGS, 0, 0, b"".join(struct.pack(">HL", k, v) for k, v in values.items()))


def parse_settings(payload: bytes) -> list[tuple[int, int]]:
    if len(payload) % 6:
        raise ProtocolViolation(FRAME_SIZE_ERROR, "SETTINGS length not a multiple of 6")
    return [struct.unpack_from(">HL", payload, i) for i in range(0, len(payload), 6)]


SETTINGS_ACK = frame(SETTINGS, ACK, 0)


def window_update(stream_id: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream_id, _U32.pack(increment))


def rst_stream(stream_id: int, code: int) -> bytes:
    return frame(RST_STREAM, 0, stream_id, _U32.pack(code))


def goaway(last_stream_id: int, code: int, debug: bytes = b"") -> bytes:
    return frame(GOAWAY, 0, 0, struct.pack(">LL", last_stream_id, code) + debug)


def u32(payload: bytes) -> int:
    value: int = _U32.unpack_from(payload)[0]
    return value


@overload
def strip_padding(flags: int, payload: bytes) -> bytes: ...
@overload
def strip_padding(flags: int, payload: memoryview) -> memoryview: ...
def strip_padding(flags: int, payload: bytes | memoryview) -> bytes | memoryview:
    """The frame's content without its padding (PADDED flag)."""
    if not flags & PADDED:
        return payload
    if not payload or payload[0] >= len(payload):
        raise ProtocolViolation(PROTOCOL_ERROR, "padding longer than the frame")
    return payload[1 : len(payload) - payload[0]]


# -- HPACK literals (RFC 7541 section 6.2.2: literal header field never touching the table) ---
def _integer(value: int, prefix_bits: int, first: int) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def literal(name: bytes, value: bytes, name_index: int = 0) -> bytes:
    """One header field as a literal without indexing; `name_index` names a static-table name."""
    head = _integer(name_index, 4, 0x00)
    if not name_index:
        head += _integer(len(name), 7, 0x00) + name
    return head + _integer(len(value), 7, 0x00) + value


STATUS_200 = b"\x88"  # static table entry 8, `:status: 200`
_CONTENT_TYPE_INDEX = 31
RESPONSE_HEADERS = STATUS_200 + literal(b"content-type", b"application/grpc", _CONTENT_TYPE_INDEX)
