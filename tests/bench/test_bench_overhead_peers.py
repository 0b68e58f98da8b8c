"""The router-against-router parts of `bench overhead --peers`: interleaving, CPU of a process
tree, the tables. Real sockets on 127.0.0.1; the "routers" here are two tiny aiohttp servers,
one of which waits 30 ms before answering (what a slow router adds)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web

from poolkeeper.bench.overhead.overhead_peers import (
    closed_loop,
    interleaved,
    latency_table,
    loop_table,
    tree_cpu_seconds,
    tree_pids,
)


@asynccontextmanager
async def server(delay_s: float, seen: list[int]) -> AsyncIterator[str]:
    async def handle(request: web.Request) -> web.Response:
        await request.read()
        seen.append(1)
        await asyncio.sleep(delay_s)
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}/v1/chat/completions"
    finally:
        await runner.cleanup()


async def test_interleaved_sends_every_tick_to_every_target_and_reports_what_each_adds() -> None:
    fast_seen: list[int] = []
    slow_seen: list[int] = []
    async with server(0.0, fast_seen) as fast, server(0.03, slow_seen) as slow:
        rows = await interleaved({"direct": fast, "slow": slow}, 40, 0.5, {"model": "m"})
    assert len(fast_seen) == len(slow_seen) == 20
    assert rows["direct"]["n"] == rows["slow"]["n"] == 20
    assert "added_p50" not in rows["direct"]
    # A sleep is a lower bound on the time it costs, so this cannot fail from noise.
    assert rows["slow"]["added_p50"] >= 25
    assert rows["slow"]["p50"] >= rows["direct"]["p50"]
    table = latency_table(rows, 40)
    assert "| direct | 20 |" in table
    assert "| slow | 20 |" in table


async def test_closed_loop_counts_requests_and_cpu_per_request() -> None:
    seen: list[int] = []
    ticks = iter([0.0, 0.5])  # a fake CPU clock: 0.5 CPU-s over the loop
    async with server(0.0, seen) as url:
        row = await closed_loop(url, {"router": lambda: next(ticks)}, 0.3, 2, {"model": "m"})
    assert row["requests"] == len(seen) > 0
    assert row["router_cpu_s"] == 0.5
    assert row["router_per_core"] == row["requests"] / 0.5
    assert "| r |" in loop_table({"r": row}, 2, 0.3)


def test_process_tree_includes_children_and_their_cpu() -> None:
    spin = "import time\nt=time.process_time()\nwhile time.process_time()-t<0.3: pass\n"
    child = subprocess.Popen([sys.executable, "-c", spin + "time.sleep(30)"])
    try:
        for _ in range(100):
            if child.pid in tree_pids(os.getpid()) and tree_cpu_seconds(child.pid) >= 0.25:
                break
            time.sleep(0.05)
        assert child.pid in tree_pids(os.getpid())
        assert tree_cpu_seconds(child.pid) >= 0.25
        assert tree_cpu_seconds(os.getpid()) >= tree_cpu_seconds(child.pid)
    finally:
        child.kill()
        child.wait()
