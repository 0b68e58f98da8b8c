"""Integration: scrapers against real simulator servers (poolkeeper.sim), through the datastore.

In-process SimClusters for metrics and LoRA state; `python -m poolkeeper.cli.sim` subprocesses
for a real kill -9 and a restart on the same port.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import suppress

import aiohttp
import pytest

from poolkeeper.api.pool import InferencePool
from poolkeeper.backend.config import ScrapingConfig
from poolkeeper.backend.scraper_manager import ScraperManager
from poolkeeper.datastore import Datastore, EndpointSpec
from poolkeeper.netutil import free_port
from poolkeeper.sim.cluster import SimCluster
from poolkeeper.sim.config import ServerSettings, build_fleet

pytestmark = pytest.mark.integration

CONFIG = ScrapingConfig(interval_ms=50, staleness_ms=400, max_backoff_ms=300)


def sim_pool() -> InferencePool:
    return InferencePool.model_validate(
        {
            "metadata": {"name": "sims"},
            "spec": {
                "selector": {"app": "sim"},
                "targetPortNumber": 8000,
                "extensionRef": {"name": "epp"},
            },
        }
    )


def store_for(ports: list[int]) -> Datastore:
    store = Datastore()
    store.set_resources([sim_pool()], [])
    store.set_endpoints(
        [EndpointSpec(f"sim-{i}", "127.0.0.1", port, labels={"app": "sim"}) for i, port in
         enumerate(ports)]
    )  # fmt: skip
    return store


# A deadline for things that happen within a few scrape intervals on a quiet machine: generous,
# so a loaded machine (a late event loop, a slow subprocess start) only makes the test slower.
EVENTUALLY_S = 30.0


async def wait_for(condition: Callable[[], bool], what: str, within: float = EVENTUALLY_S) -> None:
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within} s: {what}")
        await asyncio.sleep(0.02)


@pytest.fixture
async def clusters() -> AsyncIterator[list[SimCluster]]:
    specs = build_fleet(count=2, cli=ServerSettings(lora_adapters=["sql-lora"], max_loras=2))
    started = [SimCluster([spec]) for spec in specs]
    for cluster in started:
        await cluster.start()
    yield started
    for cluster in started:
        await cluster.stop()


async def test_metrics_and_lora_state_reach_the_datastore_and_a_stopped_server_goes_stale(
    clusters: list[SimCluster],
) -> None:
    ports = [cluster.servers[0].port for cluster in clusters]
    keys = [f"127.0.0.1:{port}" for port in ports]
    store = store_for(ports)
    async with (
        ScraperManager(CONFIG, store.update_metrics) as manager,
        aiohttp.ClientSession() as client,
    ):
        manager.follow(store)
        await wait_for(
            lambda: all(store.snapshot().metrics_for(k).updated_at > 0 for k in keys),
            "first scrape of both servers",
        )
        first = store.snapshot().metrics_for(keys[0])
        assert first.error is None
        assert (first.block_size, first.num_gpu_blocks) == (16, 28000)
        # A long LoRA request on server 0: it must show as running with its adapter.
        request = asyncio.create_task(
            client.post(
                f"http://{keys[0]}/v1/completions",
                json={"model": "sql-lora", "prompt": "hello", "max_tokens": 400},
            )
        )
        try:
            await wait_for(
                lambda: "sql-lora" in store.snapshot().metrics_for(keys[0]).active_adapters,
                "sql-lora running on server 0",
            )
            busy = store.snapshot().metrics_for(keys[0])
            assert busy.running >= 1
            assert busy.max_adapters == 2
            assert busy.kv_cache_usage > 0.0
            idle = store.snapshot().metrics_for(keys[1])
            assert (idle.running, idle.active_adapters) == (0, frozenset())
        finally:
            request.cancel()
            with suppress(asyncio.CancelledError, aiohttp.ClientError):
                await request
        # Stop server 1: marked with an error, then stale, while server 0 stays fresh.
        await clusters[1].stop()
        await wait_for(
            lambda: store.snapshot().metrics_for(keys[1]).error is not None,
            "server 1 marked failing",
        )
        await wait_for(
            lambda: store.snapshot().is_stale(keys[1], time.monotonic(), CONFIG.staleness_s),
            "server 1 stale",
        )
        # Server 0 is still scraped: judged at its next scrape, it is fresh and server 1 is
        # stale (not at an arbitrary moment: a loaded machine may delay a 50 ms scrape past
        # the 400 ms staleness, which says nothing about the scraper).
        stale_at = time.monotonic()
        await wait_for(
            lambda: store.snapshot().metrics_for(keys[0]).updated_at > stale_at,
            "server 0 scraped again",
        )
        snapshot = store.snapshot()
        now = snapshot.metrics_for(keys[0]).updated_at
        assert not snapshot.is_stale(keys[0], now, CONFIG.staleness_s)
        assert snapshot.is_stale(keys[1], now, CONFIG.staleness_s)
        assert snapshot.metrics_for(keys[0]).error is None
        assert manager.scrapers[keys[1]].failures >= 1


async def start_sim(port: int) -> asyncio.subprocess.Process:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "poolkeeper.cli.sim",
        "--count",
        "1",
        "--port",
        str(port),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert process.stdout is not None
    async with asyncio.timeout(30):
        while True:
            line = await process.stdout.readline()
            if not line:
                raise AssertionError(f"simulator exited with {await process.wait()}")
            if b"listening on" in line:
                return process


async def stop_process(process: asyncio.subprocess.Process) -> None:
    if process.returncode is None:
        process.kill()
    await process.wait()


async def test_killed_simulator_is_marked_stale_and_rejoins_after_restart() -> None:
    port = free_port()
    key = f"127.0.0.1:{port}"
    store = store_for([port])
    process = await start_sim(port)
    try:
        async with ScraperManager(CONFIG, store.update_metrics) as manager:
            manager.follow(store)
            await wait_for(lambda: store.snapshot().metrics_for(key).updated_at > 0, "first scrape")
            process.kill()
            await process.wait()
            await wait_for(
                lambda: store.snapshot().is_stale(key, time.monotonic(), CONFIG.staleness_s),
                "killed simulator stale",
            )
            error = store.snapshot().metrics_for(key).error
            assert error is not None
            assert error.startswith(("cannot connect", "ServerDisconnectedError"))
            # Restarted on the same port, it is fresh again (how soon, at most the backoff cap,
            # is test_metrics_scraper's test_backoff_doubles_and_is_capped, on an injected sleep).
            process = await start_sim(port)
            restarted = time.monotonic()
            await wait_for(
                lambda: store.snapshot().metrics_for(key).updated_at > restarted,
                "restarted simulator rejoins",
            )
            assert store.snapshot().metrics_for(key).error is None
    finally:
        await stop_process(process)
