"""A vLLM-style KV-event publisher for tests: a ZMQ PUB socket on 127.0.0.1 sending
(topic, 8-byte big-endian sequence, payload) messages, the one wait for ZMQ's slow joiner
(a SUB socket misses what is published before it has connected), and a subscriber of one
endpoint joined to one (`joined`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import zmq
import zmq.asyncio

from poolkeeper.kvevents import BlockStored, KVEventBatch, encode
from poolkeeper.netutil import free_ports
from poolkeeper.scheduling.exact_prefix import ExactPrefixIndex
from poolkeeper.scheduling.kvstats import EndpointReading
from poolkeeper.scheduling.kvsubscriber import KVEventSubscriber
from tests.support.waiting import until

ENDPOINT = "127.0.0.1:8000"
HELLO = encode(KVEventBatch(0.0, [BlockStored([1], None)]))  # what `joined` sends


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


@dataclass
class Feed:
    subscriber: KVEventSubscriber
    pub: Publisher
    seq: int  # the last sequence number sent

    def row(self) -> EndpointReading:
        (row,) = self.subscriber.reading().endpoints
        return row


@asynccontextmanager
async def joined(
    thread: bool,
    *,
    clock: Callable[[], float] = time.monotonic,
    stale_after_s: float = 1_000.0,
) -> AsyncIterator[Feed]:
    """A subscriber following ENDPOINT at a publisher's port, joined (HELLO applied)."""
    (port,) = free_ports(1)
    subscriber = KVEventSubscriber(
        ExactPrefixIndex(stale_after_s=stale_after_s),
        lambda hp: f"tcp://127.0.0.1:{port}",
        clock=clock,
        thread=thread,
    )
    subscriber.follow([ENDPOINT])
    pub = Publisher(port)
    try:
        seq = await pub.until_applied(subscriber, HELLO)
        await until(lambda: subscriber.index.match([1]), "joined")
        yield Feed(subscriber, pub, seq)
    finally:
        await asyncio.wait_for(subscriber.close(), timeout=10)
        pub.close()
