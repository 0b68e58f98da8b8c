"""Body chunks read off the wire (`wire.body_chunk`) are exactly what the protobuf parser
reads, or are left to it: the lean transport's Exchange sees the same body either way."""

from __future__ import annotations

import itertools
import json

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf.message import DecodeError
from hypothesis import given, settings, strategies as st

from poolkeeper.extproc.contracts import STREAMED, ExtProcSettings
from poolkeeper.extproc.state import Exchange
from poolkeeper.extproc.wire import (
    WIRE_FROM_BYTES,
    BodyChunk,
    body_chunk,
    read_request,
    serialize_reply,
)
from tests.extproc.extproc_fakes import FakeRouter, headers_msg, post_headers


def _chunk(body: bytes, eos: bool, metadata: bool = False) -> pb.ProcessingRequest:
    request = pb.ProcessingRequest()
    request.request_body.body = body
    request.request_body.end_of_stream = eos
    if metadata:  # an empty metadata_context, as Envoy 1.40 sends with every chunk
        request.metadata_context.SetInParent()
    return request


def _as_parsed(chunk: BodyChunk) -> pb.ProcessingRequest:
    return _chunk(bytes(chunk.body), chunk.end_of_stream)


def _parsed(wire: bytes) -> pb.ProcessingRequest:
    """The parser's reading, less an empty metadata_context (it carries nothing the Exchange
    reads: no subset hint, no served endpoint); a non-empty one stays, and fails a compare."""
    parsed = pb.ProcessingRequest.FromString(wire)
    if parsed.HasField("metadata_context") and not parsed.metadata_context.ByteSize():
        parsed.ClearField("metadata_context")
    return parsed


def test_envoys_body_chunks_are_read_as_views_of_the_message() -> None:
    for size, eos, metadata in itertools.product(
        (0, 1, 127, 128, 16_384, 262_144, 1 << 20), (False, True), (False, True)
    ):
        raw = _chunk(bytes(range(256)) * (size // 256) + b"x" * (size % 256), eos, metadata)
        wire = raw.SerializeToString()
        assert wire.endswith(b"\x42\x00") == metadata  # the bytes Envoy sends
        chunk = body_chunk(wire)
        assert chunk is not None, (size, eos)
        assert _as_parsed(chunk) == _parsed(wire)
        read = read_request(wire)  # small ones: protobuf (cheaper than reading them here)
        assert isinstance(read, BodyChunk) == (len(wire) >= WIRE_FROM_BYTES)
        assert chunk.body.obj is wire  # no copy


def test_any_other_message_is_left_to_the_parser() -> None:
    with_metadata = _chunk(b"abc", False)
    with_metadata.metadata_context.filter_metadata["envoy.lb"].fields["k"].string_value = "v"
    with_config = _chunk(b"abc", True)
    with_config.protocol_config.request_body_mode = pm.ProcessingMode.FULL_DUPLEX_STREAMED
    headers = pb.ProcessingRequest()
    headers.request_headers.headers.headers.append(base_pb2.HeaderValue(key="a", raw_value=b"b"))
    response_body = pb.ProcessingRequest()
    response_body.response_body.body = b"abc"
    for message in (with_metadata, with_config, headers, response_body, pb.ProcessingRequest()):
        wire = message.SerializeToString()
        assert body_chunk(wire) is None
        assert read_request(wire) == message
    body = _chunk(b"abc", True).SerializeToString()
    odd = [
        body + body,  # the field twice: the parser merges
        body[:-1] + b"\x02",  # end_of_stream 2: true for the parser, not canonical
        body[:-2] + b"\x10\x01" + body[-2:],  # end_of_stream twice
        body[:1] + bytes([body[1] + 2]) + body[2:] + b"\x18\x01",  # an unknown field inside
    ]
    for wire in odd:
        assert body_chunk(wire) is None


@settings(max_examples=1_000, deadline=None)
@given(
    st.binary(max_size=40)
    | st.builds(lambda b, e, m: _chunk(b, e, m).SerializeToString(),
                st.binary(max_size=300), st.booleans(), st.booleans())
    | st.builds(lambda b: b + b"\x42\x00", st.binary(max_size=40))
)  # fmt: skip
def test_a_chunk_is_read_only_where_the_parser_reads_the_same(wire: bytes) -> None:
    chunk = body_chunk(wire)
    if chunk is None:
        return
    try:
        parsed = pb.ProcessingRequest.FromString(wire)
    except DecodeError:
        raise AssertionError(f"read a chunk the parser refuses: {wire!r}") from None
    assert _as_parsed(chunk) == _parsed(wire)
    assert parsed.SerializeToString() == wire  # canonical only


@pytest.mark.parametrize("metadata", [False, True], ids=["bare", "empty-metadata"])
async def test_the_exchange_routes_the_same_from_chunks_read_either_way(metadata: bool) -> None:
    """One body in four chunks (cut inside `"model"`), each as the protobuf parser reads it and
    as `read_request` does (with Envoy's empty metadata_context too, which `read_request` now
    reads as chunks): the router sees the same bytes, the replies are the same messages
    (compared parsed from what goes on the wire: their metadata maps serialize in hash order)."""
    body = json.dumps({"model": "base", "messages": [{"role": "user", "content": "x" * 300_000}]})
    data = body.encode()
    cuts = [0, 5, 100_000, 200_000, len(data)]
    wires = [
        _chunk(data[a:b], b == len(data), metadata).SerializeToString()
        for a, b in itertools.pairwise(cuts)
    ]
    assert all(isinstance(read_request(w), BodyChunk) for w in wires[2:])
    seen = []
    for read in (pb.ProcessingRequest.FromString, read_request):
        router = FakeRouter()
        exchange = Exchange(router, settings=ExtProcSettings(default_body_mode=STREAMED))
        assert await exchange.handle(headers_msg(post_headers())) == []
        replies = [r for w in wires for r in await exchange.handle(read(w))]
        (routed,) = router.routed
        sent = [pb.ProcessingResponse.FromString(serialize_reply(r)) for r in replies]
        seen.append((routed.body, sent))
    assert seen[0] == seen[1]
    assert seen[0][0] == data
