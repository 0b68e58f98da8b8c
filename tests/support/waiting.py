"""Waiting in async tests: poll a condition until it holds. The bound is wall time and only
ends a failing test, so it is generous: a loaded machine may make a test slower, never red
(docs/testing.md)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

WITHIN_S = 30.0
SETTLE_PASSES = 100  # `settled`: loop passes, not seconds


async def settled(condition: Callable[..., object]) -> None:
    """Lets other tasks run (no wall-clock sleep) until `condition()` holds: for code driven
    by a test's own clock, where what must happen needs only the loop to turn."""
    for _ in range(SETTLE_PASSES):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


async def until(
    condition: Callable[[], object], what: str, *, within_s: float = WITHIN_S, every_s: float = 0.01
) -> None:
    """Returns once `condition()` is true; AssertionError naming `what` after `within_s`."""
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {within_s} s: {what}"
        await asyncio.sleep(every_s)


async def eventually(
    check: Callable[[], Awaitable[object]], what: str, *, within_s: float = WITHIN_S
) -> None:
    """`until` for a check that must be awaited (a health probe, a scrape)."""
    deadline = time.monotonic() + within_s
    while not await check():
        assert time.monotonic() < deadline, f"not within {within_s} s: {what}"
        await asyncio.sleep(0.025)
