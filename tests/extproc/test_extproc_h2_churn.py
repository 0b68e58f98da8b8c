"""Envoy's own stream pattern, at length, never trips the lean transport's defences.

Envoy resets every ext_proc stream once the processor's trailers arrive, and resets streams
whose client left while the EPP still worked (premature resets, 1 in 100 here). One connection
carries them all, 8 streams at a time, as Envoy multiplexes. Streams: POOLKEEPER_CHURN_STREAMS
(default 3,000). The issue's acceptance run, a day at 10 requests/s (864,000 streams), is the
`soak`-marked twin (opt-in: `pytest -m soak tests/extproc/test_extproc_h2_churn.py`; about 15
minutes of one core).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Any

import pytest

from poolkeeper.extproc.h2 import frames as f
from tests.extproc.h2_peer import PATH, Peer, echo_method, lean

pytestmark = pytest.mark.integration
STREAMS = int(os.environ.get("POOLKEEPER_CHURN_STREAMS", "3000"))


async def _route_once(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """Like the EPP: answers the first message, waits on "slow" ones, then ends the stream."""
    async for message in requests:
        if message == b"slow":
            await asyncio.Event().wait()
        yield message
        return


async def test_envoys_reset_pattern_keeps_the_connection() -> None:
    await _churn(STREAMS)


@pytest.mark.soak
@pytest.mark.timeout(3600)
async def test_a_day_of_envoys_reset_pattern_keeps_the_connection() -> None:
    await _churn(864_000)


async def _churn(streams: int) -> None:
    """`streams` streams in Envoy's pattern on one connection; it must stay up throughout."""
    async with lean({PATH: echo_method(_route_once)}) as server:
        peer = await Peer.connect(server.port)
        done = premature = 0
        while done < streams:
            batch = [peer.open() for _ in range(8)]
            slow = batch[-1] if (done // 8) % 12 == 0 else None  # 1 stream in 96
            for sid in batch:
                peer.message(sid, b"slow" if sid == slow else b"route")
            if slow is not None:
                peer.send(f.rst_stream(slow, f.CANCEL))  # the client left: a premature reset
                premature += 1
            for sid in batch:
                if sid != slow:
                    messages, trailers = await peer.response(sid)
                    assert messages == [b"route"]
                    assert trailers["grpc-status"] == "0"
                    peer.send(f.rst_stream(sid, f.INTERNAL_ERROR))  # Envoy's, after trailers
            done += len(batch)
        peer.send(f.frame(f.PING, 0, 0, b"stillup!"))
        pong = await peer.until(f.PING)
        assert pong is not None
        assert server.stats.goaways == {}
        assert server.stats.premature_resets == premature
        assert server.stats.streams == done
        assert server.stats.open_connections == 1
        await peer.close()
