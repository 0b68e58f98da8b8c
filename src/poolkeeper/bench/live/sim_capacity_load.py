"""The simulator capacity run's load and readings: closed-loop streaming clients, and what they
and the simulator measure.

`StreamClient` is one keep-alive connection issuing streaming requests back to back (a raw
protocol: it only notes the first body bytes and the chunked terminator), `client_loop` runs one
until the window closes, `Window` collects what the clients measured in it; `sim_stats` reads the
servers' model-time histograms, `cpu_seconds` a process's CPU time. `bench/live/sim_capacity.py`
runs them.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from typing import Any

import aiohttp


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


@dataclass
class Window:
    start: float
    end: float
    e2e: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    max_tokens: int = 0
    tokens: int = 0
    errors: int = 0


class StreamClient(asyncio.Protocol):
    """One keep-alive connection issuing streaming requests back to back, as cheaply as possible.

    A raw protocol rather than aiohttp's client: at 100k SSE events/s, parsing every event in
    the client would make the client, not the simulator, the bottleneck. It only notes the
    arrival of the first body bytes and the chunked-encoding terminator.
    """

    def __init__(self, host: str, port: int, body: bytes, stop_at: float, window: Window,
                 done: asyncio.Future[None]) -> None:  # fmt: skip
        self.loop = asyncio.get_running_loop()
        self.head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
            "Content-Type: application/json\r\nContent-Length: "
        ).encode()
        self.body = body
        self.stop_at = stop_at
        self.window = window
        self.done = done
        self.transport: asyncio.Transport | None = None
        self.n = 0
        self.start = 0.0
        self.first: float | None = None
        self.tail = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.send()

    def send(self) -> None:
        assert self.transport is not None
        if self.loop.time() >= self.stop_at:
            self.transport.close()
            return
        self.n += 1
        body = self.body.replace(b"@@", b"%d" % self.n, 1)  # a distinct prompt per request
        self.start = self.loop.time()
        self.first = None
        self.tail = b""
        self.transport.write(self.head + b"%d\r\n\r\n" % len(body) + body)

    def data_received(self, data: bytes) -> None:
        now = self.loop.time()
        if self.first is None:
            if not data.startswith(b"HTTP/1.1 200"):
                self.window.errors += 1
            # Headers come with the first event (aiohttp sends them with the first write).
            self.first = now
        self.tail = (self.tail + data)[-7:]
        if self.tail.endswith(b"\r\n0\r\n\r\n"[-7:]):
            if self.start >= self.window.start and now <= self.window.end:
                self.window.e2e.append(now - self.start)
                self.window.ttft.append(self.first - self.start)
                self.window.tokens += self.window.max_tokens
            self.send()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)


async def client_loop(host: str, port: int, body: bytes, stop_at: float, window: Window) -> None:
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    await loop.create_connection(
        lambda: StreamClient(host, port, body, stop_at, window, done), host, port
    )
    await done


async def sim_stats(http: aiohttp.ClientSession, urls: list[str]) -> dict[str, float]:
    out = {"e2e_sum": 0.0, "e2e_count": 0.0, "ttft_sum": 0.0, "ttft_count": 0.0,
           "itl_sum": 0.0, "itl_count": 0.0, "lag_sum": 0.0, "lag_steps": 0.0}  # fmt: skip

    async def one(url: str) -> dict[str, Any]:
        async with http.get(f"{url}/sim/stats") as response:
            result: dict[str, Any] = await response.json()
            return result

    for s in await asyncio.gather(*(one(url) for url in urls)):
        for key in ("e2e", "ttft", "itl"):
            out[f"{key}_sum"] += s[key]["sum"]
            out[f"{key}_count"] += s[key]["count"]
        # One driver per process: every server reports the same driver totals.
        out["lag_sum"] = s["driver_lag_sum"]
        out["lag_steps"] = s["driver_steps"]
    return out
