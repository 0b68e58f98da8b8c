"""The runtime's periodic housekeeping, each a task it starts and cancels on stop: the heap
given back after a burst of big request bodies (`trim_after_bursts`, `server/memory.py`) and
the response observer's waiting room expired (`expire_detached`)."""

from __future__ import annotations

import asyncio

from poolkeeper.extproc.accesslog import DetachedExchanges
from poolkeeper.extproc.contracts import BodyBudget
from poolkeeper.server.memory import trim

TRIM_AFTER_BYTES = 16 << 20  # a burst of request bodies this large is given back afterwards


async def trim_after_bursts(budget: BodyBudget, every_s: float = 2.0) -> None:
    """Once a burst of big request bodies is over (the budget back at zero), give the freed
    heap back to the OS; the receive buffers of many small chunks fragment it otherwise."""
    while True:
        await asyncio.sleep(every_s)
        if budget.used == 0 and budget.peak >= TRIM_AFTER_BYTES:
            budget.peak = 0
            await asyncio.to_thread(trim)


async def expire_detached(detached: DetachedExchanges, every_s: float = 30.0) -> None:
    """Settle exchanges whose access-log entry never came (their TTL passed): the one place
    the TTL is applied, every `every_s`, so the access-log path never scans the waiting room."""
    while True:
        await asyncio.sleep(every_s)
        detached.expire()
