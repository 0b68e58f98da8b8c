"""`MetricsScraper`: one endpoint's metrics scrape loop (one loop per endpoint is kept by
`scraper_manager.ScraperManager`).

`MetricsScraper` fetches `scheme://address:port/path`, by default over its own keep-alive
connection (backend/httpget.py; `client: aiohttp` selects a shared aiohttp session instead): no
redirects, an overall timeout, `Accept-Encoding: identity` (no decompression bombs) and a size
cap enforced while the body streams in. The page goes through the endpoint's engine mapping and
the result goes to a sink (normally `Datastore.update_metrics`).

Failure rule: a failed scrape (connection, timeout, HTTP status, size, parse error, no usable
metrics) keeps the previous values and their old `updated_at` and sets `error`, so the age grows
and consumers see the endpoint go stale. The loop never dies of it; it retries with a doubling
delay capped at `maxBackoffMs` so a restarted server rejoins within about a second.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Final

import aiohttp

from poolkeeper.backend.config import ScrapingConfig
from poolkeeper.backend.engines import EngineMapping, MissingMetrics, mapping_for
from poolkeeper.backend.httpget import HttpResponseError, KeepAliveGetter, client_ssl_context
from poolkeeper.backend.promtext import PromParseError
from poolkeeper.datastore.endpoint import Endpoint, EndpointMetrics
from poolkeeper.hostport import join_hostport

__all__ = ["MetricsScraper", "MetricsSink", "ScrapeFailed", "metrics_url"]

log = logging.getLogger(__name__)

MetricsSink = Callable[[str, EndpointMetrics], object]
Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]

_CHUNK: Final = 64 * 1024
_HEADERS: Final = {"Accept": "text/plain", "Accept-Encoding": "identity"}


class ScrapeFailed(Exception):
    """A scrape that produced no metrics; the message is what `EndpointMetrics.error` shows."""


def metrics_url(endpoint: Endpoint, config: ScrapingConfig) -> str:
    """The metrics URL of an endpoint (IPv6 addresses bracketed)."""
    return f"{config.scheme}://{join_hostport(endpoint.address, endpoint.port)}{config.path}"


class MetricsScraper:
    """The scrape loop of one endpoint: over `session` when given, else its own connection."""

    def __init__(
        self,
        endpoint: Endpoint,
        session: aiohttp.ClientSession | None,
        config: ScrapingConfig,
        sink: MetricsSink,
        *,
        clock: Clock = time.monotonic,
        sleep: Sleep = asyncio.sleep,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.key = endpoint.hostport
        self.url = metrics_url(endpoint, config)
        self.metrics = EndpointMetrics()
        self.failures = 0  # consecutive failed scrapes
        self.attempts = 0  # scrapes tried, ever
        self.failed_total = 0  # scrapes failed, ever (for the gateway's own metrics)
        self.extract_failed_total = 0  # of those, pages fetched but not readable
        # A fixed per-endpoint offset (from the key, so reproducible) added once before the
        # second scrape: loops started together spread over the interval instead of parsing
        # every page in the same tick of the event loop the ext_proc server also runs on.
        self.phase_s = config.interval_s * (zlib.crc32(self.key.encode()) % 1000) / 1000
        self._session = session
        self._config = config
        self._sink = sink
        self._clock = clock
        self._sleep = sleep
        self._timeout = aiohttp.ClientTimeout(total=config.timeout_s)
        self._getter: KeepAliveGetter | None = None
        self._last_page: bytes | None = None  # the last page read successfully
        if session is None:
            if config.scheme == "https" and ssl_context is None:
                ssl_context = client_ssl_context(verify=not config.insecure_skip_verify)
            self._getter = KeepAliveGetter(
                endpoint.address,
                endpoint.port,
                config.path,
                max_body=config.max_response_bytes,
                ssl_context=ssl_context if config.scheme == "https" else None,
            )
        self._mapping: EngineMapping | None
        self._mapping_error: str | None
        try:
            self._mapping, self._mapping_error = mapping_for(endpoint.engine), None
        except ValueError as exc:
            self._mapping, self._mapping_error = None, str(exc)

    def next_delay(self) -> float:
        """Seconds until the next scrape: the interval, doubled per consecutive failure."""
        interval = self._config.interval_s
        if self.failures == 0:
            return interval
        backoff = interval * (2.0 ** min(self.failures, 30))
        return max(interval, min(self._config.max_backoff_s, backoff))

    async def scrape_once(self) -> EndpointMetrics:
        """Fetch, parse and publish one scrape; never raises except on cancellation."""
        self.attempts += 1
        try:
            if self._mapping is None:
                raise ScrapeFailed(self._mapping_error or "unknown engine")
            body = await self._fetch()
            if body == self._last_page and self.failures == 0:
                # The same bytes as the last good page: reading them again would give the same
                # values (a read is idempotent), so only the time moves. One memcmp instead of
                # a parse at idle; any change (a gauge, a counter) takes the full read.
                fresh = replace(self.metrics, updated_at=self._clock())
            else:
                self._last_page = None
                fresh = self._mapping.read(body, self.metrics, self._clock())
                self._last_page = body
        except (ScrapeFailed, HttpResponseError) as exc:
            return self._failed(str(exc))
        except TimeoutError:
            return self._failed(f"timeout after {self._config.timeout_ms} ms")
        except aiohttp.ClientConnectorError as exc:
            reason = exc.os_error.strerror or str(exc.os_error) or type(exc.os_error).__name__
            return self._failed(f"cannot connect: {reason}")
        except aiohttp.ClientError as exc:
            return self._failed(f"{type(exc).__name__}: {exc}")
        except PromParseError as exc:
            return self._failed(f"bad metrics page: {exc}", extract=True)
        except MissingMetrics as exc:
            return self._failed(str(exc), extract=True)
        except Exception as exc:  # a bug or an odd OS error must not end the loop
            if self.failures == 0:
                log.exception("unexpected error scraping %s", self.url)
            return self._failed(f"{type(exc).__name__}: {exc}")
        if self.failures:
            log.info("metrics of %s are back after %d failed scrapes", self.key, self.failures)
        self.failures = 0
        return self._publish(fresh)

    async def run(self) -> None:
        """Scrape until cancelled, at a fixed rate while healthy, backing off while failing."""
        extra = self.phase_s
        try:
            while True:
                started = self._clock()
                await self.scrape_once()
                elapsed = self._clock() - started
                await self._sleep(max(0.0, self.next_delay() + extra - elapsed))
                extra = 0.0
        finally:
            self.close()

    def close(self) -> None:
        """Close this scraper's own connection, if it has one (`run` does so when it ends)."""
        if self._getter is not None:
            self._getter.close()

    async def _fetch(self) -> bytes:
        if self._getter is not None:
            return await self._fetch_lean(self._getter)
        return await self._fetch_aiohttp()

    async def _fetch_lean(self, getter: KeepAliveGetter) -> bytes:
        response = await getter.get(self._config.timeout_s)
        status = response.status
        if status != 200:
            if response.location is not None and 300 <= status < 400:
                raise ScrapeFailed(f"HTTP {status} redirect to {response.location} not followed")
            raise ScrapeFailed(f"HTTP {status} {response.reason}".rstrip())
        return response.body

    async def _fetch_aiohttp(self) -> bytes:
        assert self._session is not None
        cap = self._config.max_response_bytes
        async with self._session.get(
            self.url, allow_redirects=False, timeout=self._timeout, headers=_HEADERS
        ) as response:
            if response.status != 200:
                location = response.headers.get("Location")
                if location is not None and 300 <= response.status < 400:
                    raise ScrapeFailed(
                        f"HTTP {response.status} redirect to {location} not followed"
                    )
                raise ScrapeFailed(f"HTTP {response.status} {response.reason or ''}".rstrip())
            declared = response.content_length
            if declared is not None and declared > cap:
                raise ScrapeFailed(f"response of {declared} bytes exceeds the {cap}-byte limit")
            chunks: list[bytes] = []
            size = 0
            async for chunk in response.content.iter_chunked(_CHUNK):
                size += len(chunk)
                if size > cap:
                    raise ScrapeFailed(f"response exceeds the {cap}-byte limit")
                chunks.append(chunk)
        return b"".join(chunks)

    def _failed(self, reason: str, *, extract: bool = False) -> EndpointMetrics:
        self.failures += 1
        self.failed_total += 1
        self.extract_failed_total += extract
        if self.failures == 1:
            log.warning("scraping %s failed: %s", self.url, reason)
        if self.metrics.error == reason:
            return self.metrics  # nothing new to publish
        return self._publish(replace(self.metrics, error=reason))

    def _publish(self, metrics: EndpointMetrics) -> EndpointMetrics:
        self.metrics = metrics
        try:
            self._sink(self.key, metrics)
        except Exception:
            log.exception("metrics sink failed for %s", self.key)
        return metrics
