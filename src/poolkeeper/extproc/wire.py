"""ext_proc messages in wire form: the body's bytes never pass through a protobuf message.

A 1 MiB request body crosses the ext_proc stream twice, and each protobuf message it passed
through copied it: parsed into the message, read out of the field, sliced into 62 KB pieces, set
into replies, serialized. Here the body chunks Envoy sends are read off the wire as views of the
gRPC message (`read_request`), and the body mutations sent back are written as views of the body
behind a few bytes of keys and lengths (`streamed_body_wire`), byte for byte what the protobuf
serializer makes. Every other message is protobuf, built in `messages.py`; `serialize_reply`
serializes either kind, on both transports.
"""

from __future__ import annotations

from typing import Any, TypeAlias

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from poolkeeper.extproc.h2.rpc import Pieces, envelope, prefix
from poolkeeper.extproc.messages import MAX_BODY_CHUNK, streamed_body_replies


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _tag(message: type[Any], field: str, wire_type: int) -> bytes:
    """A field's key in the wire format (the field number from the message's descriptor)."""
    number: int = message.DESCRIPTOR.fields_by_name[field].number
    return _varint(number << 3 | wire_type)


# Below this many bytes a message's copies cost less than building it here in Python: small
# bodies go through protobuf as before (a chat "hi" request must not pay for 1 MiB ones).
WIRE_FROM_BYTES = 16 << 10
_LEN, _VARINT = 2, 0
_REQUEST_BODY = _tag(pb.ProcessingResponse, "request_body", _LEN)
_RESPONSE_BODY = _tag(pb.ProcessingResponse, "response_body", _LEN)
_COMMON = _tag(pb.BodyResponse, "response", _LEN)
_BODY_MUTATION = _tag(pb.CommonResponse, "body_mutation", _LEN)
_STREAMED = _tag(pb.BodyMutation, "streamed_response", _LEN)
_STREAMED_BODY = _tag(pb.StreamedBodyResponse, "body", _LEN)
_END_OF_STREAM = _tag(pb.StreamedBodyResponse, "end_of_stream", _VARINT) + b"\x01"
# What a request-body message starts with, and its HttpBody's two fields (`body_chunk`).
_REQUEST_BODY_KEY = _tag(pb.ProcessingRequest, "request_body", _LEN)
_BODY_KEY = _tag(pb.HttpBody, "body", _LEN)
_EOS_KEY = _tag(pb.HttpBody, "end_of_stream", _VARINT)
# An empty `metadata_context`: Envoy 1.40 ends every message with it (field 8, length 0).
_NO_METADATA = _tag(pb.ProcessingRequest, "metadata_context", _LEN) + b"\x00"


class BodyChunk:
    """A request-body message that carries nothing but the body and `end_of_stream` (what
    Envoy sends for every body chunk), read off the wire without the protobuf parser: `body`
    is a view of the message's bytes, where a parse copied it twice (into the message, then
    out of it on each read of the field)."""

    __slots__ = ("body", "end_of_stream")

    def __init__(self, body: memoryview, end_of_stream: bool) -> None:
        self.body = body
        self.end_of_stream = end_of_stream


Request: TypeAlias = pb.ProcessingRequest | BodyChunk


def read_request(raw: bytes) -> Request:
    """The Process method's deserializer on the lean transport: a large body chunk alone as a
    `BodyChunk`, any other message (or any other shape of one) parsed as protobuf."""
    chunk = body_chunk(raw) if len(raw) >= WIRE_FROM_BYTES else None
    return chunk or pb.ProcessingRequest.FromString(raw)


def body_chunk(raw: bytes) -> BodyChunk | None:
    """`raw` as a BodyChunk when it is exactly `request_body {body, end_of_stream}` in the
    serializer's canonical form (each field once, in order, end_of_stream 0 or 1), followed
    by nothing or by an empty `metadata_context` (as Envoy sends every chunk: an empty one
    tells the Exchange nothing); None for anything else, which the protobuf parser then reads
    (and refuses if it is malformed)."""
    if not raw.startswith(_REQUEST_BODY_KEY):
        return None
    size, at = _read_varint(raw, len(_REQUEST_BODY_KEY))
    end = len(raw)
    if size >= 0 and at + size + len(_NO_METADATA) == end and raw.endswith(_NO_METADATA):
        end -= len(_NO_METADATA)
    if size < 0 or at + size != end:
        return None  # other fields follow, or a broken length
    view = memoryview(raw)
    body = view[at:at]
    if raw.startswith(_BODY_KEY, at, end):
        n, start = _read_varint(raw, at + len(_BODY_KEY))
        if n < 0 or start + n > end:
            return None
        body, at = view[start : start + n], start + n
    end_of_stream = False
    if raw.startswith(_EOS_KEY, at, end) and end == at + len(_EOS_KEY) + 1:
        flag = raw[end - 1]
        if flag > 1:
            return None
        end_of_stream, at = flag == 1, end
    return BodyChunk(body, end_of_stream) if at == end else None


def _read_varint(data: bytes, at: int) -> tuple[int, int]:
    """(value, where the next field starts) of the varint at `at`; (-1, at) if it is cut off
    or longer than a length can be."""
    value = shift = 0
    for i in range(at, min(len(data), at + 5)):
        byte = data[i]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, i + 1
        shift += 7
    return -1, at


class WireReply:
    """A ProcessingResponse already in its wire form: `pieces`, written in order. A large
    body's bytes go out as views of it and never through a protobuf message, which copied each
    piece three times (sliced out, set, serialized: ~0.2 ms for a 1 MiB body, after routing).
    `serialize_reply` turns it, or a protobuf reply, into bytes for either transport."""

    __slots__ = ("pieces",)

    def __init__(self, pieces: tuple[bytes | memoryview, ...]) -> None:
        self.pieces = pieces

    def message(self) -> pb.ProcessingResponse:
        """The same reply as a protobuf message (for reading it, as tests do)."""
        return pb.ProcessingResponse.FromString(b"".join(self.pieces))


Reply: TypeAlias = pb.ProcessingResponse | WireReply


def serialize_reply(reply: Reply) -> bytes:
    """The reply's bytes: the one serializer of the Process method, on both transports."""
    if isinstance(reply, WireReply):
        return b"".join(reply.pieces)
    data: bytes = reply.SerializeToString()
    return data


def grpc_message(reply: Reply) -> bytes | Pieces:
    """The reply as one gRPC message (the 5-byte prefix, then `serialize_reply`'s bytes): the
    lean transport's encoder. A body mutation stays in pieces (the prefix joined to its few
    bytes of keys, then the views of the body), which the connection frames as they are: the
    body's bytes are copied only by the socket's write."""
    if isinstance(reply, WireReply):
        head, *rest = reply.pieces
        return (prefix(sum(map(len, reply.pieces))) + head, *rest)
    data: bytes = reply.SerializeToString()
    return envelope(data)


def streamed_body_wire(
    body: bytes, *, end_of_stream: bool, response: bool = False, size: int = MAX_BODY_CHUNK
) -> list[Reply]:
    """`streamed_body_replies`, byte for byte: in wire form for a large body (each piece a view
    of `body` behind its few bytes of message keys and lengths), else the protobuf replies."""
    if len(body) < WIRE_FROM_BYTES:
        return [*streamed_body_replies(body, end_of_stream=end_of_stream, response=response,
                                       size=size)]  # fmt: skip
    view = memoryview(body)
    total = len(body)
    starts = range(0, total, size) if total else range(1)
    last = starts[-1]
    outer = _RESPONSE_BODY if response else _REQUEST_BODY
    heads: dict[tuple[int, bool], bytes] = {}  # every full piece but the last has the same
    replies = []
    for start in starts:
        piece = view[start : start + size]
        n = len(piece)
        eos = end_of_stream and start == last
        head = heads.get((n, eos))
        if head is None:
            head = heads[n, eos] = _body_head(outer, n, eos)
        pieces: tuple[bytes | memoryview, ...] = (head, piece) if n else (head,)
        replies.append(WireReply((*pieces, _END_OF_STREAM) if eos else pieces))
    return replies


def _body_head(outer: bytes, n: int, eos: bool) -> bytes:
    """The keys and lengths in front of a body piece of `n` bytes in a streamed body reply."""
    # Innermost first: each message's length is what it holds (proto3 leaves out an empty
    # body and a false end_of_stream, as the protobuf serializer does).
    key = _STREAMED_BODY + _varint(n) if n else b""
    streamed = len(key) + n + (len(_END_OF_STREAM) if eos else 0)
    mutation = len(_STREAMED) + len(_varint(streamed)) + streamed
    common = len(_BODY_MUTATION) + len(_varint(mutation)) + mutation
    body_response = len(_COMMON) + len(_varint(common)) + common
    return b"".join((
        outer, _varint(body_response), _COMMON, _varint(common), _BODY_MUTATION,
        _varint(mutation), _STREAMED, _varint(streamed), key,
    ))  # fmt: skip
