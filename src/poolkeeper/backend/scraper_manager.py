"""`ScraperManager`: exactly one scrape loop (`scraper.MetricsScraper`) per endpoint, by
`ip:port`, as the datastore's endpoint set changes: new endpoints get a loop, removed ones
are stopped, an endpoint whose identity changed at the same `ip:port` gets a fresh one (no
metrics carry over). It owns the shared session or TLS context the loops use, and the
failure totals of every loop it ran."""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import aiohttp

from poolkeeper.backend.config import ScrapingConfig
from poolkeeper.backend.httpget import client_ssl_context
from poolkeeper.backend.scraper import Clock, MetricsScraper, MetricsSink, Sleep
from poolkeeper.datastore.endpoint import Endpoint

if TYPE_CHECKING:
    from poolkeeper.datastore.snapshot import DatastoreSnapshot
    from poolkeeper.datastore.store import Datastore

__all__ = ["ScraperManager"]

# The scrapers' logger, as before the manager had a module of its own.
log = logging.getLogger("poolkeeper.backend.scraper")


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class ScraperManager:
    """Keeps exactly one scrape loop per endpoint (by `ip:port`) as the endpoint set changes."""

    def __init__(
        self,
        config: ScrapingConfig,
        sink: MetricsSink,
        *,
        session: aiohttp.ClientSession | None = None,
        clock: Clock = time.monotonic,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        self._config = config
        self._sink = sink
        self._session = session
        self._owns_session = session is None
        self._ssl: ssl.SSLContext | None = None
        self._clock = clock
        self._sleep = sleep
        self._loops: dict[str, tuple[MetricsScraper, asyncio.Task[None]]] = {}
        self._stopping: set[asyncio.Task[None]] = set()
        self._unsubscribe: Callable[[], None] | None = None
        self._closed = False
        self._retired = (0, 0)  # failure totals of the loops stopped so far

    def failure_totals(self) -> tuple[int, int]:
        """(poll, extract) failures of every loop this manager ran, ever: a fetch that
        failed, and a page fetched but unreadable (upstream's data-layer error counters)."""
        polls, extracts = self._retired
        for scraper, _ in self._loops.values():
            polls += scraper.failed_total - scraper.extract_failed_total
            extracts += scraper.extract_failed_total
        return polls, extracts

    @property
    def scrapers(self) -> dict[str, MetricsScraper]:
        """The running scrapers by endpoint key (a copy)."""
        return {key: scraper for key, (scraper, _) in self._loops.items()}

    def sync(self, endpoints: Iterable[Endpoint]) -> None:
        """Start loops for new endpoints, stop removed ones, restart changed ones.

        Must be called from the event loop. An endpoint whose identity (name, namespace,
        engine) changed at the same `ip:port` gets a fresh loop, so no metrics carry over.
        """
        if self._closed:
            return
        wanted = {endpoint.hostport: endpoint for endpoint in endpoints}
        for key, (scraper, task) in list(self._loops.items()):
            if wanted.get(key) != scraper.endpoint:
                polls, extracts = self._retired
                self._retired = (
                    polls + scraper.failed_total - scraper.extract_failed_total,
                    extracts + scraper.extract_failed_total,
                )
                del self._loops[key]
                self._stop(task)
        for key, endpoint in wanted.items():
            if key not in self._loops:
                scraper = MetricsScraper(
                    endpoint,
                    self._ensure_session(),
                    self._config,
                    self._sink,
                    clock=self._clock,
                    sleep=self._sleep,
                    ssl_context=self._ensure_ssl(),
                )
                task = asyncio.create_task(scraper.run(), name=f"scrape {key}")
                task.add_done_callback(self._loop_ended)
                self._loops[key] = (scraper, task)

    def follow(self, store: Datastore) -> None:
        """Sync now and after every endpoint change of the datastore (call on the loop).

        A change written from another thread (a Kubernetes client thread, say) is handed to
        the loop, which then syncs with the datastore's latest snapshot, so out-of-order
        hand-offs can never install an older endpoint set.
        """
        loop = asyncio.get_running_loop()
        if self._unsubscribe is not None:
            self._unsubscribe()

        def latest() -> None:
            self.sync(store.snapshot().all_endpoints())

        def on_change(snapshot: DatastoreSnapshot, _kind: object) -> None:
            if _running_loop() is loop:
                self.sync(snapshot.all_endpoints())
            elif not loop.is_closed():
                loop.call_soon_threadsafe(latest)

        self._unsubscribe = store.subscribe(on_change)
        latest()

    async def close(self) -> None:
        """Stop every loop, wait for them, and close the session if this manager made it."""
        self._closed = True
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        for _, task in self._loops.values():
            self._stop(task)
        self._loops.clear()
        if self._stopping:
            await asyncio.gather(*self._stopping, return_exceptions=True)
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> ScraperManager:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _ensure_ssl(self) -> ssl.SSLContext | None:
        # One context for every lean connection (building one loads the trust store).
        if self._ssl is None and self._config.scheme == "https":
            self._ssl = client_ssl_context(verify=not self._config.insecure_skip_verify)
        return self._ssl

    def _ensure_session(self) -> aiohttp.ClientSession | None:
        if self._session is None and self._owns_session and self._config.client == "lean":
            return None  # each scraper opens its own keep-alive connection
        if self._session is None:
            verify = not self._config.insecure_skip_verify  # ssl=False skips verification
            connector = aiohttp.TCPConnector(limit=0, ssl=verify)
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session

    def _stop(self, task: asyncio.Task[None]) -> None:
        task.cancel()
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)

    def _loop_ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("scrape loop %s ended: %r", task.get_name(), task.exception())
