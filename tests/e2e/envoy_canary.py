"""A TCP listener that only counts connections: a spoofed destination must never reach it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass


@dataclass
class Canary:
    port: int = 0
    connections: int = 0
    server: asyncio.Server | None = None

    async def start(self) -> None:
        async def on_connect(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            self.connections += 1
            w.close()

        self.server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
        self.port = int(self.server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
