"""KV-cache events from a live simulated server, published the way vLLM publishes them.

A `ZmqKVEventPublisher` is the `KVEventSink` of one engine's KV cache and its
`EngineModel.kv_step_end`: what one engine step stored (its prompt blocks, allocated when the
step is planned; its output blocks, named when the step's tokens are applied) and evicted is
gathered and sent when the step ends, as one `KVEventBatch` stamped `ts = time.time()` then, in
a three-frame ZMQ PUB message: topic, 8-byte big-endian sequence number, msgpack payload
(`kvevents.py`). That is vLLM's rule (`Scheduler.update_from_output` ends each step with
`take_events()` and `publish(KVEventBatch(ts=time.time(), ...))` if there were any) and its
`ZmqEventPublisher` with `--kv-events-config '{"enable_kv_cache_events": true, "publisher":
"zmq", "endpoint": "tcp://*:5557"}'`. The live driver calls `advance` when its loop wakes for
the step's end (`loop.time()`, monotonic), so `ts` is the wall clock at that wake: the
modelled end plus the driver's lateness. No replay socket. Needs pyzmq and msgpack (the
kv-events extra).
"""

from __future__ import annotations

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

    __slots__ = ("_pending", "_seq", "_sock", "block_size", "last_ts", "topic")

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
        self.last_ts = 0.0  # the last batch's stamp (bench: scripts/step_signal.py)

    def stored(self, hashes: list[int], parent: int | None) -> None:
        pending = self._pending
        last = pending[-1] if pending else None
        # Consecutive blocks of one chain go into one event, as vLLM sends a request's run.
        if isinstance(last, BlockStored) and last.block_hashes[-1] == parent:
            last.block_hashes.extend(hashes)
        else:
            pending.append(BlockStored(list(hashes), parent, block_size=self.block_size))

    def removed(self, hashes: list[int]) -> None:
        self._pending.append(BlockRemoved(list(hashes)))

    def step_ended(self, end: float) -> None:
        """The engine's step that ends at `end` (its clock) is done: publish its events."""
        if self._pending:
            self.flush()

    def flush(self) -> None:
        """Send what is pending as one batch stamped now (non-blocking: past the HWM ZMQ
        drops it, and the subscriber sees the sequence gap)."""
        import zmq

        if not self._pending:
            return
        batch = KVEventBatch(time.time(), self._pending, 0)
        self.last_ts = batch.ts
        self._pending = []
        seq = self._seq
        self._seq += 1
        with contextlib.suppress(zmq.Again):
            self._sock.send_multipart(
                (self.topic, seq.to_bytes(8, "big"), encode(batch)), flags=zmq.NOBLOCK
            )

    @property
    def sent(self) -> int:
        """Batches sent (or dropped past the HWM) so far: the next sequence number."""
        return self._seq

    def close(self) -> None:
        self._sock.close(linger=0)
