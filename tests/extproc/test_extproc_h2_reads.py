"""Reads cut anywhere: the lean transport hands each handler the same messages, in order.

The connection reads frames where a read put them and keeps only a frame a read cut off (its
DATA goes to the message reader as views, each message joined once). So every way Envoy's
bytes can be cut into reads must give the same result: cuts inside the preface, inside a frame
header, inside a gRPC prefix, at frame edges, and one read for everything. Driven without a
socket, as `test_extproc_h2_flush.py` does.
"""

from __future__ import annotations

import asyncio
import shutil
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import hpack
import pytest

from poolkeeper.extproc.h2 import frames as f
from poolkeeper.extproc.h2.connection import Connection
from poolkeeper.extproc.h2.limits import Limits, TransportStats
from poolkeeper.extproc.h2.rpc import MessageReader, bidi, envelope
from poolkeeper.extproc.h2.server import tls_context
from poolkeeper.extproc.h2.shared import Shared
from tests.extproc.h2_peer import PATH, lean
from tests.extproc.test_extproc_h2 import _self_signed
from tests.extproc.test_extproc_h2_flush import _Transport

# Envoy's shape for a large body: messages of ~256 KiB in 16 KiB DATA frames, so message
# edges fall inside frames; small ones around them, an empty one, and a second stream.
MESSAGES = [b"", b"h", bytes(range(256)) * 1025, b"m" * 70_000, b"t" * 3]


def _wire() -> bytes:
    block = hpack.Encoder().encode(
        [(":method", "POST"), (":path", PATH), ("content-type", "application/grpc")]
    )
    out = f.PREFACE + f.settings({})
    for stream_id in (1, 3):
        out += f.frame(f.HEADERS, f.END_HEADERS, stream_id, block)
        data = b"".join(envelope(m) for m in MESSAGES)
        for at in range(0, len(data), f.DEFAULT_MAX_FRAME):
            last = at + f.DEFAULT_MAX_FRAME >= len(data)
            piece = data[at : at + f.DEFAULT_MAX_FRAME]
            out += f.frame(f.DATA, f.END_STREAM if last else 0, stream_id, piece)
    return out


async def _received(wire: bytes, cut: int) -> dict[int, list[bytes]]:
    """What each stream's handler read, with `wire` delivered in reads of `cut` bytes."""
    seen: dict[int, list[bytes]] = {}
    streams = iter((1, 3))

    async def handler(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
        mine = seen.setdefault(next(streams), [])
        async for message in requests:
            assert type(message) is bytes  # never a view of a read
            mine.append(message)
        yield b"read"

    method = bidi(handler, lambda data: data, lambda data: data)
    shared = Shared({PATH.encode(): method}, Limits(), TransportStats())
    connection = Connection(shared)
    transport = _Transport()
    connection.connection_made(transport)
    for n, at in enumerate(range(0, len(wire), cut)):
        connection.data_received(wire[at : at + cut])
        if not n % 256:  # the handlers read now and then (their windows are far larger)
            await asyncio.sleep(0)
    for _ in range(5):
        await asyncio.sleep(0)
    assert not connection.closed
    connection.connection_lost(None)
    await asyncio.sleep(0)
    return seen


@pytest.mark.parametrize("cut", [7, 9, 10, 13, 4_096, 16_393, 16_394, 65_536, 262_144, 1 << 30])
async def test_reads_cut_anywhere_give_every_message_whole_and_in_order(cut: int) -> None:
    assert await _received(_wire(), cut) == {1: MESSAGES, 3: MESSAGES}


def test_the_message_reader_takes_views_and_gives_bytes() -> None:
    """Views of reads in (as the connection hands them), exactly the messages out, as bytes;
    what is left of a view after a message stays held for the next one."""
    stream = b"".join(envelope(m) for m in MESSAGES)
    view = memoryview(stream)
    for cut in (3, 5, 6, 16_384, 262_149):
        reader = MessageReader(1 << 20)
        out = [m for at in range(0, len(stream), cut) for m in reader.feed(view[at : at + cut])]
        assert out == MESSAGES, cut
        assert all(type(m) is bytes for m in out)


async def test_a_trickled_message_does_not_pin_the_reads_it_came_in() -> None:
    """One byte of an unfinished message per ~246 KiB read (the rest DATA for a stream already
    answered, which flow control credits back at once): views would keep every read alive,
    ~94 MiB for 400 bytes counted (review). The reader copies its held bytes out once the reads
    they pin outgrow them, so the process holds almost nothing and the connection stays up."""
    handled: list[bytes] = []

    async def handler(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async for message in requests:
            handled.append(message)
        yield b"x"

    method = bidi(handler, lambda data: data, lambda data: data)
    connection = Connection(Shared({PATH.encode(): method}, Limits(), TransportStats()))
    connection.connection_made(_Transport())
    encoder = hpack.Encoder()

    def headers(stream_id: int, path: str) -> bytes:
        pairs = [(":method", "POST"), (":path", path), ("content-type", "application/grpc")]
        return f.frame(f.HEADERS, f.END_HEADERS, stream_id, encoder.encode(pairs))

    connection.data_received(
        f.PREFACE
        + f.settings({})
        + headers(1, PATH)
        + headers(3, "/nope")  # answered at once (unimplemented): its DATA is dropped
        + f.frame(f.DATA, 0, 1, b"\x00" + (60 << 20).to_bytes(4, "big"))  # 60 MiB begins
    )
    junk = f.frame(f.DATA, 0, 3, b"j" * 16_384) * 15
    tracemalloc.start()
    try:
        for _ in range(400):
            connection.data_received(f.frame(f.DATA, 0, 1, b"b") + junk)
            await asyncio.sleep(0)
        held, _peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert not connection.closed
    assert handled == []  # the message is unfinished
    assert held < 8 << 20, held  # 2 x held + 1 MiB of reads at most, plus the loop's own


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_large_replies_arrive_whole_over_tls_on_uvloop(tmp_path: Path) -> None:
    """A large reply's frames go to the transport as views (`writelines`): over TLS, on
    uvloop as `serve` runs, grpcio's client still reads every byte."""
    uvloop = pytest.importorskip("uvloop")
    cert, key = _self_signed(tmp_path)
    sent = [b"a", bytes(range(256)) * 1_200, b"z" * 1_000_000]

    async def exchange() -> list[bytes]:
        async with lean(tls=tls_context(str(cert), str(key))) as server:
            credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
            async with grpc.aio.secure_channel(f"localhost:{server.port}", credentials) as ch:
                return [r async for r in ch.stream_stream(PATH)(iter(sent))]

    assert uvloop.run(exchange()) == sent
