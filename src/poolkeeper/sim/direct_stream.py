"""Streaming tokens from the stepping loop straight to the client's socket.

After a streaming response has sent its headers and first event through aiohttp, its later
events are written by the RealtimeDriver itself, synchronously, as HTTP/1.1 chunks: no task
switch and no await per token, which is what lets one process carry ~1,000 concurrent streams.
The handler only wakes at the end (or when the client has gone) to finish the response.
"""

from __future__ import annotations

import asyncio
from typing import Any

from poolkeeper.sim.driver import TokenWaiter
from poolkeeper.sim.openai_format import ChunkWriter, usage_dict
from poolkeeper.sim.request import SimRequest
from poolkeeper.sim.textgen import text_between


def usage_of(request: SimRequest) -> dict[str, Any]:
    return usage_dict(request.prompt_tokens, request.output_tokens, request.cached_tokens)


def event_boundary(produced: int, done: bool, interval: int) -> int:
    """How many of `produced` tokens the events sent so far may cover (`--stream-interval`):
    like vLLM, the first token goes alone, then one event per `interval` tokens, and the rest
    with the finish. A stream written late (a busy loop delivered several steps at once) sends
    the groups that are complete, merged, and never cuts a group in two."""
    if done or produced <= 1:
        return produced
    return 1 + (produced - 1) // interval * interval


class DirectStream:
    """Writes a stream's tokens from the driver, synchronously, as HTTP/1.1 chunks."""

    __slots__ = (
        "broken", "finished", "interval", "seed", "sent", "transport", "waiter", "writer"
    )  # fmt: skip

    def __init__(
        self,
        transport: asyncio.BaseTransport,
        waiter: TokenWaiter,
        writer: ChunkWriter,
        seed: int,
        sent: int,
        interval: int = 1,
    ) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        self.interval = interval
        self.transport: asyncio.WriteTransport = transport
        self.waiter = waiter
        self.writer = writer
        self.seed = seed
        self.sent = sent
        self.broken = False
        self.finished = False

    def push(self) -> None:
        if self.broken or self.finished:
            return
        if self.transport.is_closing():
            self.broken = True
            self.waiter.notify()
            return
        request = self.waiter.request
        done = request.done
        produced = event_boundary(request.output_tokens, done, self.interval)
        if not done and produced <= self.sent:
            return  # batch tokens per event (--stream-interval); the last one always goes
        text = ""
        if produced > self.sent:
            reason = request.finish_reason if done else None
            text = self.writer.text(text_between(self.seed, self.sent, produced), reason)
            self.sent = produced
        if done:
            if self.writer.include_usage:
                text += self.writer.usage(usage_of(request))
            text += self.writer.done()
        if text:
            data = text.encode()
            self.transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        if done:
            self.finished = True
            self.waiter.notify()
