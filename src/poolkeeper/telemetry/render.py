"""/metrics rendered off the event loop, one render at a time for every scrape waiting.

A large page (1,000 fairness ids of one model: 64 MB, seconds of rendering) rendered once per
concurrent scrape multiplied the work and the pages held in memory, and on the loop's default
executor it queued ahead of the config reloads and housekeeping that share it (review of the
outside audit: 8 scrapes at once, 5 s each and 223 ms of loop lag). So scrapes that arrive
while a render is in flight wait for that render's page; one that arrives after it finished
starts a new one (a page is never older than the scrape's arrival minus one render). Renders
run on a thread of their own, stopped with the runtime (`close`).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from prometheus_client import generate_latest

from poolkeeper.telemetry.exposition import Exposition


class OffLoopRenderer:
    """The exposition's page, rendered on one dedicated thread, shared by concurrent scrapes."""

    def __init__(self, exposition: Exposition) -> None:
        self._exposition = exposition
        # Threads start on the first render only, so an unscraped GatewayMetrics costs none.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="metrics-render")
        self._rendering: asyncio.Future[bytes] | None = None

    async def render(self) -> bytes:
        """The page; the collectors of the EPP's state run here, on the loop (`snapshot`)."""
        pending = self._rendering
        if pending is None or pending.done():
            snapshot = self._exposition.snapshot()
            loop = asyncio.get_running_loop()
            pending = loop.run_in_executor(self._pool, generate_latest, snapshot)
            pending.add_done_callback(self._rendered)
            self._rendering = pending
        # One scraper gone (its client hung up) must not cancel the page the others wait for.
        return await asyncio.shield(pending)

    def _rendered(self, done: asyncio.Future[bytes]) -> None:
        if self._rendering is done:
            self._rendering = None
        if not done.cancelled():
            done.exception()  # retrieved: every waiter may have gone before it ended

    async def close(self) -> None:
        """Stop the render thread, after a render in progress (waited for off the loop)."""
        await asyncio.to_thread(self._pool.shutdown, wait=True, cancel_futures=True)
