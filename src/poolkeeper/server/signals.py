"""The signals that stop the long-running commands (`serve`, `epp`, `sim`, `quickstart`).

SIGINT (Ctrl-C), SIGTERM (a process manager, Kubernetes) and SIGHUP (the terminal closed) all
mean "drain and stop", so a closed terminal drains as Ctrl-C does instead of killing the
process halfway. Handlers run in the event loop (`loop.add_signal_handler`).
`serve_until_signalled` runs a started-then-stopped service (the runtime) between them."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable
from typing import Protocol

STOP_SIGNALS: tuple[signal.Signals, ...] = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)
)


def on_stop_signals(
    loop: asyncio.AbstractEventLoop, callback: Callable[[], object]
) -> Callable[[], None]:
    """Calls `callback` on each stop signal, where the loop can handle signals (not on Windows,
    nor outside the main thread); returns the function that removes these handlers again."""
    installed = []
    for sig in STOP_SIGNALS:
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, callback)
            installed.append(sig)

    def remove() -> None:
        for sig in installed:
            loop.remove_signal_handler(sig)

    return remove


class Service(Protocol):
    """What `serve_until_signalled` runs: the runtime (`server/runtime.py`)."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


async def serve_until_signalled(service: Service, started: asyncio.Event | None = None) -> None:
    """Start, run until SIGINT, SIGTERM or SIGHUP, then drain and stop."""
    stop = asyncio.Event()
    remove_handlers = on_stop_signals(asyncio.get_running_loop(), stop.set)
    try:
        await service.start()
        if started is not None:
            started.set()
        await stop.wait()
    finally:
        # Handlers stay installed while draining: a second Ctrl-C must not interrupt the drain
        # with a KeyboardInterrupt halfway through stopping the servers.
        await service.stop()
        remove_handlers()
