"""MetricsScraper and ScraperManager against a local aiohttp server on 127.0.0.1.

Every test taking `session` runs on both clients: an aiohttp session, and None (the lean
keep-alive client of backend/httpget.py, the default)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from poolkeeper.api.pool import InferencePool
from poolkeeper.backend.config import ScrapingConfig
from poolkeeper.backend.engines import EngineMapping
from poolkeeper.backend.scraper import MetricsScraper, metrics_url
from poolkeeper.backend.scraper_manager import ScraperManager
from poolkeeper.datastore import Datastore, EndpointSpec
from poolkeeper.datastore.endpoint import Endpoint, EndpointMetrics
from poolkeeper.netutil import free_port

VLLM_PAGE = (Path(__file__).parent / "fixtures" / "vllm_v1.prom").read_bytes()

pytestmark = pytest.mark.integration


@dataclass
class FakeServer:
    port: int
    page: bytes = VLLM_PAGE
    status: int = 200
    hits: dict[str, int] = field(default_factory=dict)
    streamed: int = 0


class Clock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def server() -> AsyncIterator[FakeServer]:
    state = FakeServer(port=0)

    def count(request: web.Request) -> None:
        state.hits[request.path] = state.hits.get(request.path, 0) + 1

    async def metrics(request: web.Request) -> web.Response:
        count(request)
        return web.Response(body=state.page, status=state.status, content_type="text/plain")

    async def slow(request: web.Request) -> web.Response:
        count(request)
        await asyncio.sleep(5)
        return web.Response(body=VLLM_PAGE)

    async def redirect(request: web.Request) -> web.Response:
        count(request)
        raise web.HTTPFound("/metrics")

    async def huge(request: web.Request) -> web.StreamResponse:
        count(request)
        response = web.StreamResponse()
        response.content_type = "text/plain"
        await response.prepare(request)
        line = b"# padding line that is not a metric, repeated to make a 50 MB page ...\n"
        chunk = line * (65536 // len(line))
        try:
            while state.streamed < 50 * 1024 * 1024:
                await response.write(chunk)
                state.streamed += len(chunk)
        except (ConnectionResetError, ConnectionError):
            pass
        return response

    async def declared(request: web.Request) -> web.Response:
        count(request)
        return web.Response(body=b"x" * 5000)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/slow", slow)
    app.router.add_get("/redirect", redirect)
    app.router.add_get("/huge", huge)
    app.router.add_get("/declared", declared)
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    sockets: list[socket.socket] = list(getattr(site._server, "sockets", None) or [])
    assert sockets
    state.port = sockets[0].getsockname()[1]
    yield state
    await runner.cleanup()


@pytest.fixture(params=["aiohttp", "lean"])
async def session(request: pytest.FixtureRequest) -> AsyncIterator[aiohttp.ClientSession | None]:
    if request.param == "lean":
        yield None
        return
    async with aiohttp.ClientSession() as client:
        yield client


def endpoint(port: int, engine: str = "vllm") -> Endpoint:
    return Endpoint("sim-0", "127.0.0.1", port, engine=engine)


def make_scraper(
    port: int,
    session: aiohttp.ClientSession | None,
    sink: list[tuple[str, EndpointMetrics]],
    clock: Clock | None = None,
    engine: str = "vllm",
    **config: object,
) -> MetricsScraper:
    return MetricsScraper(
        endpoint(port, engine),
        session,
        ScrapingConfig.model_validate(config),
        lambda key, metrics: sink.append((key, metrics)),
        clock=clock or Clock(),
    )


async def test_successful_scrape_publishes_metrics(
    server: FakeServer, session: aiohttp.ClientSession | None
) -> None:
    sink: list[tuple[str, EndpointMetrics]] = []
    scraper = make_scraper(server.port, session, sink, Clock(42.0))
    metrics = await scraper.scrape_once()
    assert (metrics.waiting, metrics.running, metrics.kv_cache_usage) == (3, 7, 0.4217)
    assert metrics.active_adapters == {"sql-lora", "tweet-lora"}
    assert metrics.updated_at == 42.0
    assert metrics.error is None
    assert sink == [(f"127.0.0.1:{server.port}", metrics)]


async def test_http_error_keeps_old_values_and_timestamp_then_recovers(
    server: FakeServer, session: aiohttp.ClientSession | None
) -> None:
    sink: list[tuple[str, EndpointMetrics]] = []
    clock = Clock(10.0)
    scraper = make_scraper(server.port, session, sink, clock)
    good = await scraper.scrape_once()
    server.status = 500
    clock.now = 11.0
    failed = await scraper.scrape_once()
    assert failed.error == "HTTP 500 Internal Server Error"
    assert failed.updated_at == 10.0
    assert failed.waiting == good.waiting
    # The same failure again publishes nothing new.
    await scraper.scrape_once()
    assert len(sink) == 2
    assert scraper.failures == 2
    server.status = 200
    clock.now = 12.0
    back = await scraper.scrape_once()
    assert back.error is None
    assert back.updated_at == 12.0
    assert scraper.failures == 0
    assert (scraper.attempts, scraper.failed_total) == (4, 2)


async def test_timeout_is_marked(server: FakeServer, session: aiohttp.ClientSession | None) -> None:
    sink: list[tuple[str, EndpointMetrics]] = []
    scraper = make_scraper(server.port, session, sink, path="/slow", timeoutMs=100)
    loop = asyncio.get_running_loop()
    started = loop.time()
    metrics = await scraper.scrape_once()
    assert loop.time() - started < 2.0
    assert metrics.error == "timeout after 100 ms"
    assert metrics.updated_at == 0.0


async def test_redirects_are_not_followed(
    server: FakeServer, session: aiohttp.ClientSession | None
) -> None:
    sink: list[tuple[str, EndpointMetrics]] = []
    scraper = make_scraper(server.port, session, sink, path="/redirect")
    metrics = await scraper.scrape_once()
    assert metrics.error == "HTTP 302 redirect to /metrics not followed"
    assert server.hits == {"/redirect": 1}


async def test_50_mb_page_is_cut_off_at_the_cap(
    server: FakeServer, session: aiohttp.ClientSession | None
) -> None:
    sink: list[tuple[str, EndpointMetrics]] = []
    scraper = make_scraper(server.port, session, sink, path="/huge")
    metrics = await scraper.scrape_once()
    assert metrics.error == "response exceeds the 4194304-byte limit"
    await asyncio.sleep(0.05)
    assert server.streamed < 50 * 1024 * 1024


async def test_declared_length_over_the_cap_is_refused_before_reading(
    server: FakeServer, session: aiohttp.ClientSession | None
) -> None:
    sink: list[tuple[str, EndpointMetrics]] = []
    scraper = make_scraper(server.port, session, sink, path="/declared", maxResponseBytes=1024)
    metrics = await scraper.scrape_once()
    assert metrics.error == "response of 5000 bytes exceeds the 1024-byte limit"


@pytest.mark.parametrize(
    ("page", "expected"),
    [
        (b"<html><body>Bad Gateway</body></html>", "no usable vllm metrics"),
        (b'vllm:num_requests_waiting{model_name="x" 3\n', "bad metrics page: line 1:"),
        (b"vllm:num_requests_waiting NaN\nvllm:num_requests_running NaN\n", "no usable vllm"),
        (VLLM_PAGE[: VLLM_PAGE.index(b"vllm:num_requests_running{") + 30], "bad metrics page"),
    ],
    ids=["html", "garbage", "nan", "truncated"],
)
async def test_bad_pages_are_marked(
    server: FakeServer, session: aiohttp.ClientSession | None, page: bytes, expected: str
) -> None:
    server.page = page
    sink: list[tuple[str, EndpointMetrics]] = []
    metrics = await make_scraper(server.port, session, sink).scrape_once()
    assert metrics.error is not None
    assert expected in metrics.error
    assert metrics.updated_at == 0.0


async def test_refused_connection_is_marked(session: aiohttp.ClientSession | None) -> None:
    sink: list[tuple[str, EndpointMetrics]] = []
    metrics = await make_scraper(free_port(), session, sink).scrape_once()
    assert metrics.error is not None
    assert metrics.error.startswith("cannot connect")


async def test_unknown_engine_is_marked_without_fetching(
    server: FakeServer, session: aiohttp.ClientSession | None
) -> None:
    sink: list[tuple[str, EndpointMetrics]] = []
    metrics = await make_scraper(server.port, session, sink, engine="tgi").scrape_once()
    assert metrics.error is not None
    assert "unknown engine type 'tgi'" in metrics.error
    assert server.hits == {}


async def test_backoff_doubles_and_is_capped(session: aiohttp.ClientSession | None) -> None:
    sleeps: list[float] = []

    async def fake_sleep(delay: float) -> None:
        sleeps.append(delay)
        if len(sleeps) == 7:
            raise asyncio.CancelledError

    scraper = MetricsScraper(
        endpoint(free_port()),
        session,
        ScrapingConfig(interval_ms=50, max_backoff_ms=500),
        lambda _k, _m: None,
        clock=Clock(),
        sleep=fake_sleep,
    )
    with pytest.raises(asyncio.CancelledError):
        await scraper.run()
    assert 0.0 <= scraper.phase_s < 0.05
    assert sleeps == pytest.approx([0.1 + scraper.phase_s, 0.2, 0.4, 0.5, 0.5, 0.5, 0.5])
    assert (scraper.attempts, scraper.failed_total, scraper.failures) == (7, 7, 7)


def test_metrics_url() -> None:
    config = ScrapingConfig(scheme="https", path="/m")
    assert metrics_url(Endpoint("x", "10.0.0.1", 8000), config) == "https://10.0.0.1:8000/m"
    assert metrics_url(Endpoint("x", "fd00::1", 80), config) == "https://[fd00::1]:80/m"


def simple_pool(port: int) -> InferencePool:
    return InferencePool.model_validate(
        {
            "metadata": {"name": "p"},
            "spec": {
                "selector": {"app": "x"},
                "targetPortNumber": port,
                "extensionRef": {"name": "epp"},
            },
        }
    )


async def test_manager_follows_datastore_endpoints(server: FakeServer) -> None:
    store = Datastore()
    store.set_resources([simple_pool(server.port)], [])
    key = f"127.0.0.1:{server.port}"
    async with ScraperManager(ScrapingConfig(interval_ms=20), store.update_metrics) as manager:
        manager.follow(store)
        assert set(manager.scrapers) == set()
        store.set_endpoints([EndpointSpec("sim", "127.0.0.1", labels={"app": "x"})])
        assert set(manager.scrapers) == {key}
        first = manager.scrapers[key]
        for _ in range(100):
            if store.snapshot().metrics_for(key).updated_at > 0:
                break
            await asyncio.sleep(0.02)
        assert store.snapshot().metrics_for(key).running == 7
        # Same ip:port, different identity: a fresh loop.
        store.set_endpoints([EndpointSpec("sim-new", "127.0.0.1", labels={"app": "x"})])
        assert manager.scrapers[key] is not first
        store.set_endpoints([])
        assert manager.scrapers == {}
    assert manager.scrapers == {}


async def test_manager_close_cancels_loops(session: aiohttp.ClientSession | None) -> None:
    manager = ScraperManager(ScrapingConfig(), lambda _k, _m: None, session=session)
    manager.sync([endpoint(free_port()), Endpoint("b", "127.0.0.1", free_port())])
    assert len(manager.scrapers) == 2
    tasks = [t for t in asyncio.all_tasks() if t.get_name().startswith("scrape ")]
    assert len(tasks) == 2
    await manager.close()
    assert all(t.done() for t in tasks)
    assert session is None or not session.closed  # a session passed in is the caller's
    manager.sync([endpoint(free_port())])  # after close: ignored
    assert manager.scrapers == {}


async def test_manager_follows_writes_from_other_threads(
    session: aiohttp.ClientSession | None,
) -> None:
    store = Datastore()
    store.set_resources([simple_pool(1)], [])
    port = free_port()
    async with ScraperManager(ScrapingConfig(), store.update_metrics, session=session) as manager:
        manager.follow(store)
        await asyncio.to_thread(
            store.set_endpoints, [EndpointSpec("t", "127.0.0.1", port, labels={"app": "x"})]
        )
        for _ in range(50):
            if manager.scrapers:
                break
            await asyncio.sleep(0.01)
        assert set(manager.scrapers) == {f"127.0.0.1:{port}"}


async def test_failure_totals_split_fetch_and_read_failures_and_outlive_their_loops(
    server: FakeServer, session: aiohttp.ClientSession | None
) -> None:
    """Upstream's data-layer error counters: a fetch that failed (poll) and a page fetched but
    unreadable (extract); a counter, so a stopped loop's failures are kept."""
    scraper = make_scraper(server.port, session, [])
    server.status = 500
    await scraper.scrape_once()  # poll failure
    server.status, server.page = 200, b"not a metrics page {{{"
    await scraper.scrape_once()  # extract failure
    assert (scraper.failed_total, scraper.extract_failed_total) == (2, 1)
    manager = ScraperManager(
        ScrapingConfig(interval_ms=60_000), lambda _k, _m: None, session=session
    )
    try:
        manager.sync([endpoint(server.port)])
        (running,) = manager.scrapers.values()
        running.failed_total, running.extract_failed_total = 5, 2
        assert manager.failure_totals() == (3, 2)
        manager.sync([])  # the endpoint left: its loop stops, its failures stay counted
        assert manager.failure_totals() == (3, 2)
    finally:
        await manager.close()


async def test_an_identical_page_is_not_parsed_again(
    server: FakeServer, session: aiohttp.ClientSession | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: list[int] = []
    original = EngineMapping.read

    def counted(self: EngineMapping, *args: Any) -> EndpointMetrics:
        reads.append(1)
        return original(self, *args)

    monkeypatch.setattr(EngineMapping, "read", counted)
    clock = Clock(10.0)
    scraper = make_scraper(server.port, session, [], clock)
    first = await scraper.scrape_once()
    clock.now = 11.0
    same = await scraper.scrape_once()
    assert len(reads) == 1
    assert same == replace(first, updated_at=11.0)
    server.page = VLLM_PAGE.replace(
        b'Llama-3.1-8B-Instruct"} 3.0\n', b'Llama-3.1-8B-Instruct"} 9\n'
    )
    changed = await scraper.scrape_once()
    assert (len(reads), changed.waiting) == (2, 9)
    server.status = 500
    await scraper.scrape_once()
    server.status = 200
    clock.now = 12.0
    back = await scraper.scrape_once()  # the same bytes again, but after a failure: read
    assert (len(reads), back.waiting, back.updated_at, back.error) == (3, 9, 12.0, None)
    scraper.close()


async def test_client_setting_picks_the_transport() -> None:
    for client, shared in (("lean", False), ("aiohttp", True)):
        config = ScrapingConfig.model_validate({"client": client, "intervalMs": 60_000})
        async with ScraperManager(config, lambda _k, _m: None) as manager:
            manager.sync([endpoint(free_port())])
            (scraper,) = manager.scrapers.values()
            assert (scraper._session is not None) is shared
