"""When the lean transport writes a reply: as the handler's step ends, not after the others'.

Envoy delivers a burst of streams in one read; each gets a handler task, and every task runs in
the same pass of the loop. A reply held until the end of that pass would wait for the routing
of every other stream in the burst (in a closed loop, the whole burst would then reach the model
servers together, and they would idle meanwhile). Driven without a socket: what the connection
has handed its transport is exactly what it wrote.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import hpack

from poolkeeper.extproc.h2 import frames as f
from poolkeeper.extproc.h2.connection import Connection
from poolkeeper.extproc.h2.limits import Limits, TransportStats
from poolkeeper.extproc.h2.shared import Shared
from tests.extproc.h2_peer import PATH, echo_method, grpc_message


class _Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()

    def write(self, data: Any) -> None:
        self.out += data

    def close(self) -> None: ...

    def is_closing(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


def _frames(data: bytes) -> list[tuple[int, int, int]]:
    """(type, flags, stream id) of each frame written."""
    out, at = [], 0
    while len(data) - at >= f.HEADER_LEN:
        length, kind, flags, stream_id = f.parse_head(data, at)
        out.append((kind, flags, stream_id))
        at += f.HEADER_LEN + length
    return out


def _ended(data: bytes, stream_id: int) -> bool:
    """The stream's trailers (HEADERS with END_STREAM) were written."""
    return any(
        kind == f.HEADERS and flags & f.END_STREAM and sid == stream_id
        for kind, flags, sid in _frames(data)
    )


async def _burst(wait_for_more: bool) -> tuple[bool, bool]:
    """Streams 1 and 3 in one read. Stream 1's handler answers (and then ends, or waits for
    more input); when stream 3's handler first runs, has stream 1's reply been written?"""
    transport = _Transport()
    seen: list[bytes] = []

    async def handler(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async for message in requests:
            if message == b"second":
                seen.append(bytes(transport.out))
            yield message
            if not wait_for_more:
                return

    shared = Shared({PATH.encode(): echo_method(handler)}, Limits(), TransportStats())
    connection = Connection(shared)
    connection.connection_made(transport)
    block = hpack.Encoder().encode(
        [(":method", "POST"), (":path", PATH), ("content-type", "application/grpc")]
    )
    burst = f.PREFACE + f.settings({})
    for stream_id, payload in ((1, b"first"), (3, b"second")):
        burst += f.frame(f.HEADERS, f.END_HEADERS, stream_id, block)
        burst += f.frame(f.DATA, 0, stream_id, grpc_message(payload))
    connection.data_received(burst)
    for _ in range(3):
        await asyncio.sleep(0)
    connection.connection_lost(None)
    await asyncio.sleep(0)
    assert len(seen) == 1
    return _ended(seen[0], 1), any(kind == f.DATA and sid == 1 for kind, _, sid in _frames(seen[0]))


async def test_a_finished_streams_reply_is_written_before_the_next_handler_runs() -> None:
    ended, replied = await _burst(wait_for_more=False)
    assert replied
    assert ended


async def test_a_reply_is_written_when_its_handler_waits_for_more_input() -> None:
    ended, replied = await _burst(wait_for_more=True)
    assert replied
    assert not ended  # the handler still runs: no trailers yet


async def test_a_large_reply_is_written_before_the_handler_makes_the_next() -> None:
    """A body sent back in 62 KB pieces goes on to Envoy piece by piece, not all at the end."""
    transport = _Transport()
    written: list[int] = []

    async def handler(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async for _ in requests:
            yield b"x" * 62_000
            written.append(len(transport.out))
            yield b"small"
            written.append(len(transport.out))
            return

    shared = Shared({PATH.encode(): echo_method(handler)}, Limits(), TransportStats())
    connection = Connection(shared)
    connection.connection_made(transport)
    block = hpack.Encoder().encode(
        [(":method", "POST"), (":path", PATH), ("content-type", "application/grpc")]
    )
    connection.data_received(
        f.PREFACE
        + f.settings({})
        + f.frame(f.HEADERS, f.END_HEADERS, 1, block)
        + f.frame(f.DATA, f.END_STREAM, 1, grpc_message(b"go"))
    )
    for _ in range(3):
        await asyncio.sleep(0)
    connection.connection_lost(None)
    await asyncio.sleep(0)
    assert written[0] > 62_000  # the large reply left before the next was made
    assert written[1] == written[0]  # a small one waits for the end of the step
    assert _ended(bytes(transport.out), 1)
