"""Body mutations in wire form (`wire.streamed_body_wire`): the protobuf serializer's exact
bytes, with the body's pieces as views of the body (no copy before the socket's)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from typing import Any

import hpack
import pytest

from poolkeeper.extproc import messages as msg, wire
from poolkeeper.extproc.h2 import frames as f
from poolkeeper.extproc.h2.connection import Connection
from poolkeeper.extproc.h2.limits import Limits, TransportStats
from poolkeeper.extproc.h2.rpc import bidi, envelope
from poolkeeper.extproc.h2.shared import Shared
from tests.extproc.h2_peer import PATH

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
        assert [r.message() if isinstance(r, wire.WireReply) else r for r in written] == made
        assert all(isinstance(r, wire.WireReply) for r in written) == (n >= wire.WIRE_FROM_BYTES)


def test_a_one_piece_body_is_the_bytes_the_piecewise_builder_makes() -> None:
    """A body in one piece is set as it is (no view, slice or copy); the general loop (taken
    for any other type of body) makes the same bytes, and the piece is the body itself."""
    for n, eos, response in itertools.product(SIZES, (False, True), (False, True)):
        body = _body(n)
        quick = msg.streamed_body_replies(body, end_of_stream=eos, response=response)
        general = msg.streamed_body_replies(
            bytearray(body),  # type: ignore[arg-type]  # the general loop takes any buffer
            end_of_stream=eos,
            response=response,
        )
        assert [r.SerializeToString() for r in quick] == [r.SerializeToString() for r in general]
        assert len(quick) == max(1, -(-n // msg.MAX_BODY_CHUNK))


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


def test_a_grpc_message_is_the_prefix_and_the_serialized_reply() -> None:
    body = _body(200_000)
    replies: list[wire.Reply] = [*wire.streamed_body_wire(body, end_of_stream=True)]
    replies.append(msg.trailers_reply(response=False))
    for reply in replies:
        message = wire.grpc_message(reply)
        joined = b"".join(message) if isinstance(message, tuple) else message
        assert joined == envelope(wire.serialize_reply(reply))
        # A body mutation stays in pieces: the body's bytes are views of it, never joined.
        assert isinstance(message, tuple) == isinstance(reply, wire.WireReply)


class _Recorder(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[list[Any]] = []

    def write(self, data: Any) -> None:
        self.calls.append([data])

    def writelines(self, list_of_data: Any) -> None:
        self.calls.append(list(list_of_data))

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def get_write_buffer_size(self) -> int:
        return 0

    def is_closing(self) -> bool:
        return False

    def close(self) -> None: ...


@pytest.mark.parametrize("writev", [True, False])
async def test_a_large_reply_reaches_the_transport_as_views_of_it(writev: bool) -> None:
    """On uvloop the lean transport hands a large reply's frames over as they are (no joined
    copy): every byte of the message goes out as a view of the message the encoder made. On
    the standard loop (whose `writelines` skipped backpressure on some 3.12 releases) the
    frames are joined into one write."""
    sent: list[bytes] = []

    async def handler(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async for _ in requests:
            yield _body(300_000)

    def encode(data: bytes) -> bytes:
        sent.append(envelope(data))
        return sent[-1]

    method = bidi(handler, lambda data: data, encode, enveloped=True)
    connection = Connection(Shared({PATH.encode(): method}, Limits(), TransportStats()))
    transport = _Recorder()
    connection.connection_made(transport)
    assert not connection._writev  # not uvloop's transport
    connection._writev = writev  # as on uvloop, or not
    block = hpack.Encoder().encode([(":method", "POST"), (":path", PATH)])
    connection.data_received(
        f.PREFACE + f.settings({f.INITIAL_WINDOW_SIZE: 1 << 20})
        + f.window_update(0, 1 << 20) + f.frame(f.HEADERS, f.END_HEADERS, 1, block)
        + f.frame(f.DATA, f.END_STREAM, 1, envelope(b"go"))
    )  # fmt: skip
    for _ in range(5):
        await asyncio.sleep(0)
    views = [p for call in transport.calls for p in call if isinstance(p, memoryview)]
    assert sent
    assert all(v.obj is sent[0] for v in views)
    if writev:
        assert sum(map(len, views)) == len(sent[0])
    else:
        assert views == []
        written = b"".join(p for call in transport.calls for p in call)
        assert len(written) > len(sent[0])  # every byte went out, framed
    connection.connection_lost(None)


def _written(body: bytes, encode: Any, settings: dict[int, int], window: int) -> list[Any]:
    """What a lean connection writes for `body`'s replies (`streamed_body_wire`, encoded by
    `encode`), the peer announcing `settings` and a connection window of `window`."""

    async def handler(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async for _ in requests:
            for reply in wire.streamed_body_wire(body, end_of_stream=True):
                yield reply

    async def run() -> list[Any]:
        method = bidi(handler, lambda data: data, encode, enveloped=True)
        connection = Connection(Shared({PATH.encode(): method}, Limits(), TransportStats()))
        transport = _Recorder()
        connection.connection_made(transport)
        connection._writev = True  # as on uvloop
        block = hpack.Encoder().encode([(":method", "POST"), (":path", PATH)])
        connection.data_received(
            f.PREFACE + f.settings(settings) + f.window_update(0, window)
            + f.frame(f.HEADERS, f.END_HEADERS, 1, block)
            + f.frame(f.DATA, f.END_STREAM, 1, envelope(b"go"))
        )  # fmt: skip
        for _ in range(5):
            await asyncio.sleep(0)
        if window < len(body) * 2:  # the rest of the replies once the peer gives credit
            connection.data_received(f.window_update(0, 4 << 20) + f.window_update(1, 4 << 20))
            for _ in range(5):
                await asyncio.sleep(0)
        connection.connection_lost(None)
        return [p for call in transport.calls for p in call]

    return asyncio.run(run())


def _joined_message(reply: wire.Reply) -> bytes:
    message = wire.grpc_message(reply)
    return b"".join(message) if isinstance(message, tuple) else message


@pytest.mark.parametrize(
    ("settings", "window"),
    [
        ({f.INITIAL_WINDOW_SIZE: 4 << 20}, 4 << 20),  # Envoy's: nothing waits
        ({f.INITIAL_WINDOW_SIZE: 4 << 20, f.MAX_FRAME_SIZE: 100_000}, 4 << 20),  # larger frames
        ({f.INITIAL_WINDOW_SIZE: 4 << 20, f.MAX_FRAME_SIZE: 16_385}, 4 << 20),
        ({f.INITIAL_WINDOW_SIZE: 100_000}, 4 << 20),  # the stream's window holds replies back
        ({f.INITIAL_WINDOW_SIZE: 4 << 20}, 200_000),  # the connection's does
    ],
)
def test_a_reply_in_pieces_is_framed_as_its_joined_bytes(
    settings: dict[int, int], window: int
) -> None:
    """The connection frames an encoder's pieces exactly as it frames the same message joined
    (the same frames, byte for byte, under any frame size and window), and where nothing waits
    for window, every byte of the body goes out as a view of the body itself."""
    for n in (wire.WIRE_FROM_BYTES, 62_000, 300_001, 1 << 20):
        body = _body(n)
        pieces = _written(body, wire.grpc_message, settings, window)
        joined = _written(body, _joined_message, settings, window)
        as_bytes = [bytes(p) for p in pieces]
        assert b"".join(as_bytes) == b"".join(bytes(p) for p in joined), (n, settings, window)
        if min(window, settings[f.INITIAL_WINDOW_SIZE]) > 2 * n:  # nothing waits
            views = [p for p in pieces if isinstance(p, memoryview) and p.obj is body]
            assert sum(map(len, views)) == n, (n, settings, window)
