"""A grpc.aio server on a thread and event loop of its own (`OwnLoopServer`).

For a service whose answer must not wait on `serve`'s main event loop: the per-client-address
connection counter (extproc/conncap.py). Envoy gives each of its checks a deadline and lets
the connection in when the answer is late; answered on the main loop, a check queued behind
the EPP's work, and on a loaded gateway (load average 13, 50 streaming clients) took 204 ms at
the median and 315 ms at p95, so the cap (then 250 ms) was not enforced. On its own loop a
check waits only for the interpreter lock, which a busy main thread hands over every switch
interval (5 ms), and for the CPU.

The server is built, started, run and stopped on the thread (grpc.aio binds a server to the
loop it was made in); the caller's loop only waits on futures. The thread is a daemon: a
process that exits without `stop` is not held up by it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable

import grpc

# Builds the server (not started) and returns it with the port it is bound to.
Build = Callable[[], tuple[grpc.aio.Server, int]]


class OwnLoopServer:
    """`build`'s server, run on a daemon thread named `name` with a new event loop."""

    def __init__(self, build: Build, name: str) -> None:
        self._build = build
        self._name = name
        self.port = 0  # once started
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: grpc.aio.Server | None = None
        self._thread: threading.Thread | None = None
        self._finish: asyncio.Event | None = None  # set on the thread's loop: its run ends

    async def start(self) -> None:
        """Build and start the server on its thread; raises what building or starting raised."""
        started: concurrent.futures.Future[int] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._run, args=(started,), name=self._name, daemon=True
        )
        self._thread.start()
        self.port = await asyncio.wrap_future(started)

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The thread's event loop, while it runs."""
        return self._loop

    async def stop(self, grace: float | None) -> None:
        """Stop the server (`grace` as grpc.aio's `stop`) and end its thread; idempotent."""
        loop, server, thread = self._loop, self._server, self._thread
        if loop is None or server is None or thread is None or not thread.is_alive():
            return
        try:
            stopping = asyncio.run_coroutine_threadsafe(server.stop(grace), loop)
            await asyncio.wrap_future(stopping)
            finish = self._finish
            if finish is not None:
                loop.call_soon_threadsafe(finish.set)
        except RuntimeError:  # the thread's loop has already closed
            return
        await asyncio.to_thread(thread.join, 5.0)

    def _run(self, started: concurrent.futures.Future[int]) -> None:
        # asyncio.run sets the thread's current loop (grpc.aio asks for it) and, at the end,
        # cancels what the server's handlers left running and closes the loop.
        asyncio.run(self._serve(started))

    async def _serve(self, started: concurrent.futures.Future[int]) -> None:
        self._loop = asyncio.get_running_loop()
        self._finish = asyncio.Event()
        try:
            server, port = self._build()
            await server.start()
        except BaseException as exc:  # the caller's start raises it
            started.set_exception(exc)
            return
        self._server = server
        started.set_result(port)
        await self._finish.wait()
