"""KV-cache events from a live simulated server, published the way vLLM publishes them.

A `ZmqKVEventPublisher` is the `KVEventSink` of one engine's KV cache: the stores and evictions
of one engine step are gathered and sent once the step's callbacks are done (one `call_soon`),
as one `KVEventBatch` in a three-frame ZMQ PUB message: topic, 8-byte big-endian sequence
number, msgpack payload (`kvevents.py`), like vLLM's `ZmqEventPublisher` with
`--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:5557"}'`. No replay socket. Needs pyzmq and msgpack (the kv-events extra).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from poolkeeper.errors import ConfigError
from poolkeeper.kvevents import (
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    encode,
)


class ZmqKVEventPublisher:
    """PUB socket bound to `address` (e.g. tcp://127.0.0.1:5557) for one engine."""

    __slots__ = ("_pending", "_scheduled", "_seq", "_sock", "block_size", "topic")

    def __init__(self, address: str, *, block_size: int, topic: str = "kv") -> None:
        try:
            import zmq
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise ConfigError(
                "KV events need the pyzmq package: pip install 'poolkeeper[kv-events]'"
            ) from exc
        self._sock: Any = zmq.Context.instance().socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 100_000)
        self._sock.bind(address)
        self.block_size = block_size
        self.topic = topic.encode()
        self._seq = 0
        self._pending: list[KVEvent] = []
        self._scheduled = False

    def stored(self, hashes: list[int], parent: int | None) -> None:
        pending = self._pending
        last = pending[-1] if pending else None
        # Consecutive blocks of one chain go into one event, as vLLM sends a request's run.
        if isinstance(last, BlockStored) and last.block_hashes[-1] == parent:
            last.block_hashes.extend(hashes)
        else:
            pending.append(BlockStored(list(hashes), parent, block_size=self.block_size))
        self._schedule()

    def removed(self, hashes: list[int]) -> None:
        self._pending.append(BlockRemoved(list(hashes)))
        self._schedule()

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        """Send what is pending as one batch (non-blocking: past the HWM ZMQ drops it, and
        the subscriber sees the sequence gap)."""
        import zmq

        self._scheduled = False
        if not self._pending:
            return
        batch = KVEventBatch(time.time(), self._pending, 0)
        self._pending = []
        seq = self._seq
        self._seq += 1
        with contextlib.suppress(zmq.Again):
            self._sock.send_multipart(
                (self.topic, seq.to_bytes(8, "big"), encode(batch)), flags=zmq.NOBLOCK
            )

    def close(self) -> None:
        self._sock.close(linger=0)
