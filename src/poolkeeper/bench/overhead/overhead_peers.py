"""Router against router: the latency each one adds over a direct call, and its CPU per request.

`poolkeeper.bench.overhead.gateway_overhead --peers vllm-router,sglang-router` (or `poolkeeper bench
overhead --peers ...`) starts each peer router (installed by `scripts/install-peers.sh`) in
front of the same one-token simulator as the gateway, then:

- at a light open-loop rate, one *tick* every 1/rate seconds sends the same request to every
  target one after another (direct, poolkeeper, each peer), the order rotated tick by tick, so
  every router meets the same machine state; reported per router: p50 / p99 of its latency and
  of its per-tick difference to the direct call (what it adds);
- a closed loop per router (16 clients, a few seconds each, one router at a time): requests/s
  and requests per CPU-second of the router's whole process tree (for poolkeeper: EPP and
  Envoy together, and the EPP alone).

Local only, bounded (ticks = rate x duration; fixed closed-loop windows).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

import aiohttp


def tree_pids(pid: int) -> list[int]:
    """`pid` and all its descendants (from /proc's children lists)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        try:
            tasks = os.listdir(f"/proc/{current}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{current}/task/{task}/children") as f:
                    todo += [int(child) for child in f.read().split()]
            except OSError:
                continue
    return found


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of `pid` and its descendants (alive ones)."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for each in tree_pids(pid):
        try:
            with open(f"/proc/{each}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def timed(session: aiohttp.ClientSession, url: str, data: bytes) -> float:
    began = time.perf_counter()
    async with session.post(url, data=data, headers={"content-type": "application/json"}) as r:
        await r.read()
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}")
    return time.perf_counter() - began


async def paced(n: int, rate: float, tick: Callable[[int], Coroutine[Any, Any, None]]) -> None:
    """Start `tick(0..n-1)` one every 1/rate s (open loop: a slow tick does not delay the
    next), and wait for all of them."""
    start = time.perf_counter()
    tasks = []
    for i in range(n):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(tick(i)))
    await asyncio.gather(*tasks)


async def interleaved(
    targets: Mapping[str, str], rate: float, duration: float, body: dict[str, Any]
) -> dict[str, dict[str, float]]:
    """Per target: p50/p99 latency (ms) and, except for "direct", added p50/p99 per tick."""
    names = list(targets)
    n = max(1, int(rate * duration))
    data = json.dumps(body).encode()
    ticks: list[dict[str, float]] = [{} for _ in range(n)]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def tick(i: int) -> None:
            order = names[i % len(names) :] + names[: i % len(names)]
            for name in order:
                ticks[i][name] = await timed(session, targets[name], data) * 1000

        await paced(n, rate, tick)
    out: dict[str, dict[str, float]] = {}
    for name in names:
        seen = [t[name] for t in ticks]
        row = {"n": float(len(seen)), "p50": _pct(seen, 0.5), "p99": _pct(seen, 0.99)}
        if name != "direct":
            diff = [t[name] - t["direct"] for t in ticks]
            row |= {"added_p50": _pct(diff, 0.5), "added_p99": _pct(diff, 0.99)}
        out[name] = row
    return out


async def closed_loop(
    url: str,
    cpu: Mapping[str, Callable[[], float]],
    seconds: float,
    clients: int,
    body: dict[str, Any],
) -> dict[str, float]:
    """Requests/s through `url`, and requests per CPU-second of each named CPU clock."""
    done = 0
    data = json.dumps(body).encode()
    stop_at = time.perf_counter() + seconds
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < stop_at:
                await timed(session, url, data)
                done += 1

        cpu0 = {name: clock() for name, clock in cpu.items()}
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        t1 = time.perf_counter()
        cpu1 = {name: clock() for name, clock in cpu.items()}
    row = {"requests": float(done), "rps": done / (t1 - t0)}
    for name in cpu:
        used = cpu1[name] - cpu0[name]
        row[f"{name}_cpu_s"] = used
        row[f"{name}_per_core"] = done / used if used > 0 else float("nan")
    return row


def latency_table(light: dict[str, dict[str, float]], rate: float) -> str:
    lines = [
        f"Interleaved at {rate:g} ticks/s (each tick: every target once, order rotated):\n",
        "| target | requests | p50 / p99 ms | added p50 / p99 ms |",
        "|---|---|---|---|",
    ]
    for name, row in light.items():
        added = f"{row['added_p50']:.2f} / {row['added_p99']:.2f}" if "added_p50" in row else "-"
        lines.append(f"| {name} | {row['n']:.0f} | {row['p50']:.2f} / {row['p99']:.2f} | {added} |")
    return "\n".join(lines)


def loop_table(loops: dict[str, dict[str, float]], clients: int, seconds: float) -> str:
    lines = [
        f"Closed loop, {clients} clients, {seconds:g} s per router, one router at a time:\n",
        "| router | requests/s | requests per CPU-second |",
        "|---|---|---|",
    ]
    for name, row in loops.items():
        cores = ", ".join(
            f"{key[: -len('_per_core')]} {value:.0f}"
            for key, value in row.items()
            if key.endswith("_per_core")
        )
        lines.append(f"| {name} | {row['rps']:.0f} | {cores} |")
    return "\n".join(lines)
