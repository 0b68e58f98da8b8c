"""Body mutations in wire form (`wire.streamed_body_wire`): the protobuf serializer's exact
bytes, with the body's pieces as views of the body (no copy before the socket's)."""

from __future__ import annotations

import itertools

from poolkeeper.extproc import messages as msg, wire

SIZES = [0, 1, 127, 128, 129, 16_383, 16_384, 61_999, 62_000, 62_001, 124_000, 300_000]
SIZES += [1 << 20, (1 << 20) + 88]


def _body(n: int) -> bytes:
    return (bytes(range(256)) * (n // 256 + 1))[:n]


def test_wire_replies_are_the_serializers_bytes() -> None:
    for n, eos, response, chunk in itertools.product(
        SIZES, (False, True), (False, True), (msg.MAX_BODY_CHUNK, 1_000, 4 << 20)
    ):
        body = _body(n)
        made = msg.streamed_body_replies(body, end_of_stream=eos, response=response, size=chunk)
        written = wire.streamed_body_wire(body, end_of_stream=eos, response=response, size=chunk)
        expected = [r.SerializeToString() for r in made]
        assert [wire.serialize_reply(r) for r in written] == expected, (n, eos, response, chunk)
        assert [r.message() for r in written] == made


def test_the_body_goes_out_as_views_of_itself() -> None:
    body = _body(1 << 20)
    written = wire.streamed_body_wire(body, end_of_stream=True)
    views = [p for r in written for p in r.pieces if isinstance(p, memoryview)]
    assert len(views) == len(written) == -(-len(body) // msg.MAX_BODY_CHUNK)
    assert all(v.obj is body for v in views)
    assert sum(map(len, views)) == len(body)
    # Everything else is message keys and lengths: a few bytes per reply.
    assert all(len(p) <= 24 for r in written for p in r.pieces if not isinstance(p, memoryview))


def test_protobuf_replies_serialize_as_before() -> None:
    reply = msg.trailers_reply(response=False)
    assert wire.serialize_reply(reply) == reply.SerializeToString()
