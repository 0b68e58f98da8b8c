"""A small asyncio TCP fault proxy on 127.0.0.1 (what Toxiproxy does, for the tests).

Modes, per proxy: pass bytes through with added latency; reset the client connection after N
bytes of the upstream's answer; black-hole (accept, read, never answer); close (accept, read
the request, close before answering). Each accepted connection is counted, so tests can tell
whether a request reached the proxy at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from dataclasses import dataclass, field
from enum import Enum


class Fault(Enum):
    PASS = "pass"  # forward both ways (with `latency_s` before each upstream chunk)
    RESET_AFTER = "reset_after"  # forward, then RST the client after `reset_after` bytes
    BLACK_HOLE = "black_hole"  # accept and read; never answer
    CLOSE = "close"  # read the request head, then close (RST) before any byte of answer


@dataclass
class FaultProxy:
    upstream_port: int = 0
    fault: Fault = Fault.PASS
    latency_s: float = 0.0
    reset_after: int = 0
    port: int = 0
    connections: int = 0
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def hostport(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._on_client, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self._serve(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            self._tasks.discard(task)
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.fault is Fault.BLACK_HOLE:
            while await reader.read(65536):
                pass
            return
        if self.fault is Fault.CLOSE:
            await reader.readuntil(b"\r\n\r\n")
            _reset(writer)
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        try:
            up = asyncio.create_task(_pump(reader, up_writer, 0.0, None, None))
            down = asyncio.create_task(
                _pump(
                    up_reader,
                    writer,
                    self.latency_s,
                    self.reset_after if self.fault is Fault.RESET_AFTER else None,
                    writer,
                )
            )
            await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
            await asyncio.gather(down, return_exceptions=True)
            up.cancel()
            await asyncio.gather(up, return_exceptions=True)
        finally:
            up_writer.close()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with RST (SO_LINGER 0), as a crashed server's kernel would."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def _pump(
    src: asyncio.StreamReader,
    dst: asyncio.StreamWriter,
    latency_s: float,
    budget: int | None,
    reset: asyncio.StreamWriter | None,
) -> None:
    sent = 0
    while data := await src.read(65536):
        if latency_s:
            await asyncio.sleep(latency_s)  # the fault itself, not synchronisation
        if budget is not None and sent + len(data) >= budget:
            dst.write(data[: budget - sent])
            await dst.drain()
            assert reset is not None
            _reset(reset)
            return
        dst.write(data)
        await dst.drain()
        sent += len(data)
    if dst.can_write_eof():
        dst.write_eof()
