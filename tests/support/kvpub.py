"""A vLLM-style KV-event publisher for tests: a ZMQ PUB socket on 127.0.0.1 sending
(topic, 8-byte big-endian sequence, payload) messages, and the one wait for ZMQ's slow joiner
(a SUB socket misses what is published before it has connected)."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from poolkeeper.scheduling.kvsubscriber import KVEventSubscriber


class Publisher:
    """A PUB socket bound on 127.0.0.1:`port`; `close` it."""

    def __init__(self, port: int) -> None:
        self._ctx = zmq.asyncio.Context()
        self.pub = self._ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(f"tcp://127.0.0.1:{port}")

    async def send(self, seq: int, payload: bytes, topic: bytes = b"kv") -> None:
        await self.pub.send_multipart([topic, seq.to_bytes(8, "big"), payload])

    async def until_applied(
        self, subscriber: KVEventSubscriber, payload: bytes, first_seq: int = 0, every: int = 1
    ) -> int:
        """Send `payload` numbered from `first_seq` (a step of `every`) until one more batch is
        applied (bounded: connecting on loopback takes a few tries); the last number sent."""
        received, seq = subscriber.received, first_seq
        for _ in range(500):
            await self.send(seq, payload)
            for _ in range(10):
                if subscriber.received > received:
                    return seq
                await asyncio.sleep(0.002)
            seq += every
        raise AssertionError("no KV-event batch reached the subscriber")

    def close(self) -> None:
        self.pub.close(linger=0)
        self._ctx.term()
