"""The lean transport's frame parser and state machine against arbitrary frame sequences.

Each example feeds a connection a valid preface and then frames of every type with random
flags, stream ids and payloads (some with valid header blocks and gRPC messages, to reach the
deeper states), cut into random chunks. The connection must never raise, never leave a
handler error unobserved, and either keep serving or end with GOAWAY.

Examples: POOLKEEPER_FUZZ_EXAMPLES (default 150). The issue's acceptance run, 100,000
sequences, is the `soak`-marked twin (opt-in: `pytest -m soak` on this file; about 40
minutes of one core).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from typing import Any

import hpack
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from poolkeeper.extproc.h2 import frames as f
from poolkeeper.extproc.h2.connection import Connection
from poolkeeper.extproc.h2.limits import Limits, TransportStats
from poolkeeper.extproc.h2.shared import Shared
from tests.extproc.h2_peer import PATH, echo_method, grpc_message

EXAMPLES = int(os.environ.get("POOLKEEPER_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ACCEPTANCE = settings(FUZZ, max_examples=100_000)


class _Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()
        self.closed = False

    def write(self, data: Any) -> None:
        assert not self.closed, "a write after close"
        self.out += data

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.closed = True

    def get_write_buffer_size(self) -> int:
        return len(self.out)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


_HEADERS = hpack.Encoder().encode(
    [(":method", "POST"), (":path", PATH), ("content-type", "application/grpc")]
)
_payloads = st.one_of(
    st.binary(max_size=48),
    st.just(_HEADERS),
    st.builds(grpc_message, st.binary(max_size=32)),
    st.binary(min_size=8, max_size=8),  # PING-sized
    st.binary(min_size=4, max_size=4),  # RST_STREAM / WINDOW_UPDATE-sized
    st.sampled_from([f.settings({f.INITIAL_WINDOW_SIZE: 1})[9:], b"\x00\x05\x00\x00\x00\x01"]),
)
_frames = st.builds(
    f.frame,
    st.sampled_from([*range(10), 0x42]),
    st.sampled_from(
        [
            0,
            f.END_STREAM,
            f.END_HEADERS,
            f.END_HEADERS | f.END_STREAM,
            f.PADDED,
            f.PRIORITY_FLAG,
            0xFF,
        ]
    ),
    st.sampled_from([0, 1, 3, 5, 2, 7, (1 << 31) - 1]),
    _payloads,
)


async def _feed(chunks: list[bytes]) -> None:
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    limits = Limits(control_burst=50, reset_burst=20, max_concurrent_streams=4)
    shared = Shared({PATH.encode(): echo_method()}, limits, TransportStats())
    connection = Connection(shared)
    transport = _Transport()
    connection.connection_made(transport)
    for chunk in chunks:
        connection.data_received(chunk)
        await asyncio.sleep(0)
    for _ in range(5):
        await asyncio.sleep(0)
    connection.connection_lost(None)
    await asyncio.sleep(0)
    assert not errors, errors
    assert shared.stats.active_streams == 0
    _whole_frames(bytes(transport.out))


def _whole_frames(data: bytes) -> None:
    """What the server wrote is whole frames, each within the default maximum size."""
    at = 0
    while len(data) - at >= 9:
        length, _, _, _ = f.parse_head(data, at)
        assert length <= f.DEFAULT_MAX_FRAME
        at += 9 + length
    assert at == len(data)


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """One loop for all examples (a loop per example would cost more than the example)."""
    runner = asyncio.Runner()
    yield runner.get_loop()
    runner.close()


_sequences = given(
    frames=st.lists(_frames, max_size=24), cuts=st.lists(st.integers(1, 64), max_size=8)
)


@FUZZ
@_sequences
def test_any_frame_sequence_is_served_or_refused_never_crashes(
    loop: asyncio.AbstractEventLoop, frames: list[bytes], cuts: list[int]
) -> None:
    _serve_cut(loop, frames, cuts)


@pytest.mark.soak
@pytest.mark.timeout(7200)
@ACCEPTANCE
@_sequences
def test_the_acceptance_run_of_100000_sequences(
    loop: asyncio.AbstractEventLoop, frames: list[bytes], cuts: list[int]
) -> None:
    _serve_cut(loop, frames, cuts)


def _serve_cut(loop: asyncio.AbstractEventLoop, frames: list[bytes], cuts: list[int]) -> None:
    """The preface and `frames`, cut after each of `cuts` bytes, fed to one connection."""
    data = f.PREFACE + b"".join(frames)
    chunks, at = [], 0
    for cut in cuts:
        chunks.append(data[at : at + cut])
        at += cut
    chunks.append(data[at:])
    loop.run_until_complete(_feed([c for c in chunks if c]))
