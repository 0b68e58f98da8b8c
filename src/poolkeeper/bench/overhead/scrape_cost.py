"""CPU per metrics scrape: the lean keep-alive client vs aiohttp, interleaved in one run.

    .venv/bin/python -m poolkeeper.bench.overhead.scrape_cost [--rounds 6] [--endpoints 20]

A child process serves a realistic vLLM V1 page (`--page`, default
tests/backend/fixtures/vllm_v1.prom) on `--endpoints` ports of 127.0.0.1 (aiohttp server, so
its CPU is not ours). This process then measures, per round and per client (`scraping.client`
lean and aiohttp, alternated, the order flipped every round), the whole `MetricsScraper`
(fetch, parse, map, publish) on uvloop, as the EPP runs, in three shapes, as process CPU time,
after the GET alone (the two clients' own cost, no parse):

- back to back: `--scrapes` calls of `scrape_once` on one endpoint, CPU us per scrape;
- with gaps: the same with `--gap-ms` of sleep between scrapes (idle between scrapes, as in a
  real EPP: caches go cold), CPU us per scrape (the sleep's wake-up included);
- idle manager: a `ScraperManager` at the default 50 ms interval over every endpoint for
  `--seconds`, publishing to a `Datastore` as the EPP does: CPU ms per second.

The page changes every scrape (a counter line appended), as a busy server's does; `--pages same`
serves identical bytes, which the scraper recognises and does not parse again. Prints one
Markdown table (median of rounds, with the range) and the host's `uptime`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import uvloop

from poolkeeper.backend.config import ScrapingConfig
from poolkeeper.backend.httpget import KeepAliveGetter
from poolkeeper.backend.scraper import MetricsScraper
from poolkeeper.backend.scraper_manager import ScraperManager
from poolkeeper.datastore.endpoint import Endpoint

PAGE = Path("tests") / "backend" / "fixtures" / "vllm_v1.prom"  # run from the repository root
CLIENTS = ("lean", "aiohttp")

_SERVER = """
import asyncio, sys
from aiohttp import web
page = open(sys.argv[1], "rb").read()
same = sys.argv[3] == "same"
served = [0]
async def metrics(request):
    served[0] += 1  # a changing line, as a live server's counters change between scrapes
    body = page if same else page + b"process_served_total %d\\n" % served[0]
    return web.Response(body=body, content_type="text/plain")
async def main():
    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    ports = []
    for _ in range(int(sys.argv[2])):
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        ports.append(site._server.sockets[0].getsockname()[1])
    print(" ".join(map(str, ports)), flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


async def _scrapes(client: str, port: int, count: int, gap_s: float) -> float:
    """CPU us per scrape over `count` scrapes (after 20 warm-up scrapes)."""
    config = ScrapingConfig(client=client)  # type: ignore[arg-type]
    session = None
    if client == "aiohttp":
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    scraper = MetricsScraper(
        Endpoint("sim", "127.0.0.1", port), session, config, lambda _k, _m: None
    )
    try:
        for _ in range(20):
            await scraper.scrape_once()
        started = time.process_time()
        for _ in range(count):
            if gap_s:
                await asyncio.sleep(gap_s)
            await scraper.scrape_once()
        spent = time.process_time() - started
        if scraper.metrics.error:
            raise SystemExit(f"scrape failed: {scraper.metrics.error}")
        return spent / count * 1e6
    finally:
        scraper.close()
        if session is not None:
            await session.close()


async def _fetches(client: str, port: int, count: int) -> float:
    """CPU us per GET of the page alone (no parse), back to back, after 20 warm-up GETs."""
    limit_s = ScrapingConfig().timeout_s
    if client == "lean":
        lean = KeepAliveGetter("127.0.0.1", port, "/metrics", max_body=1 << 22)

        async def fetch() -> bytes:
            return (await lean.get(limit_s)).body
    else:
        session = aiohttp.ClientSession()
        timeout = aiohttp.ClientTimeout(total=limit_s)
        url = f"http://127.0.0.1:{port}/metrics"

        async def fetch() -> bytes:
            async with session.get(
                url, allow_redirects=False, timeout=timeout, headers={"Accept-Encoding": "identity"}
            ) as response:
                return await response.read()

    try:
        for _ in range(20):
            await fetch()
        started = time.process_time()
        for _ in range(count):
            await fetch()
        return (time.process_time() - started) / count * 1e6
    finally:
        if client == "lean":
            lean.close()
        else:
            await session.close()


async def _idle(client: str, ports: list[int], seconds: float) -> float:
    """CPU ms per second of a manager scraping every port at the default interval."""
    from poolkeeper.datastore import Datastore

    store = Datastore()
    config = ScrapingConfig(client=client)  # type: ignore[arg-type]
    endpoints = [Endpoint(f"sim-{i}", "127.0.0.1", port) for i, port in enumerate(ports)]
    async with ScraperManager(config, store.update_metrics) as manager:
        manager.sync(endpoints)
        await asyncio.sleep(1.0)  # connections made, phases spread
        started, wall = time.process_time(), time.monotonic()
        await asyncio.sleep(seconds)
        spent, wall = time.process_time() - started, time.monotonic() - wall
        errors = [s.metrics.error for s in manager.scrapers.values() if s.metrics.error]
        if errors:
            raise SystemExit(f"scrape failed: {errors[0]}")
    return spent / wall * 1e3


async def _run(args: argparse.Namespace, ports: list[int]) -> None:
    rows: dict[tuple[str, str], list[float]] = {}
    shapes: tuple[tuple[str, Callable[[str], Awaitable[float]]], ...] = (
        ("GET alone, back to back, us", lambda c: _fetches(c, ports[0], args.scrapes)),
        ("back to back, us/scrape", lambda c: _scrapes(c, ports[0], args.scrapes, 0.0)),
        (
            f"{args.gap_ms:g} ms gaps, us/scrape",
            lambda c: _scrapes(c, ports[0], args.scrapes // 4, args.gap_ms / 1000),
        ),
        (
            f"{len(ports)} endpoints every 50 ms, CPU ms/s",
            lambda c: _idle(c, ports, args.seconds),
        ),
    )
    print(f"start: {_uptime()}", flush=True)
    for round_ in range(args.rounds):
        order = CLIENTS if round_ % 2 == 0 else CLIENTS[::-1]
        for name, shape in shapes:
            for client in order:
                value = await shape(client)
                rows.setdefault((name, client), []).append(value)
        print(f"round {round_ + 1}/{args.rounds} done: {_uptime()}", flush=True)
    print()
    print("| shape | lean (median [range]) | aiohttp (median [range]) | aiohttp / lean |")
    print("|---|---|---|---|")
    for name, _ in shapes:
        lean, heavy = rows[(name, "lean")], rows[(name, "aiohttp")]
        ratio = statistics.median(h / ll for h, ll in zip(heavy, lean, strict=True))
        print(f"| {name} | {_fmt(lean)} | {_fmt(heavy)} | {ratio:.2f}x |")
    print(f"\nend: {_uptime()}")


def _fmt(values: list[float]) -> str:
    return f"{statistics.median(values):.0f} [{min(values):.0f}-{max(values):.0f}]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="interleaved rounds (default 6)")
    parser.add_argument("--scrapes", type=int, default=2000, help="scrapes back to back")
    parser.add_argument("--gap-ms", type=float, default=20.0, help="idle between scrapes")
    parser.add_argument("--endpoints", type=int, default=20, help="servers for the idle shape")
    parser.add_argument("--seconds", type=float, default=5.0, help="idle shape's length")
    parser.add_argument(
        "--pages",
        choices=("changing", "same"),
        default="changing",
        help="a page that changes every scrape (default) or the same bytes every time",
    )
    parser.add_argument("--page", type=Path, default=PAGE, help=f"metrics page (default {PAGE})")
    args = parser.parse_args(argv)
    if not args.page.is_file():
        print(f"error: no metrics page at {args.page}; pass --page PATH", file=sys.stderr)
        return 2
    server = subprocess.Popen(
        [sys.executable, "-c", _SERVER, str(args.page), str(args.endpoints), args.pages],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    try:
        assert server.stdout is not None
        ports = [int(p) for p in server.stdout.readline().split()]
        if len(ports) != args.endpoints:
            print("error: the page server did not start", file=sys.stderr)
            return 1
        uvloop.run(_run(args, ports))  # the EPP's loop (cli/epp.py)
    finally:
        server.terminate()
        server.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
