"""Large prompts through `serve` variants and the lean floor: latency in two shapes, CPU, faults.

Starts one simulator (`overhead_gateway.SIM_CONFIG`), one `poolkeeper serve` per
`--variant NAME=[PYTHONPATH]` (empty: this tree; else e.g. a `git archive` of main's `src/`) and
the floor gateways (`overhead_floor`: Envoy alone and Envoy + the lean do-nothing processor).
Then, `--rounds` times, in turn:

- one *size-pairs* phase per variant: direct and that serve only, alternated tick by tick (what
  `gateway_overhead`'s "Prompt sizes" table measures, `paired`), its added p50 also split by
  which of the two went first in the tick;
- one *interleaved* phase: every target in each tick, the order rotated (what its "Against the
  peer routers" tables measure, `overhead_peers.interleaved`).

Each phase prints the added p50 per target (per-tick difference to direct). Both rows of the
acceptance benchmark come from the same function over the same body; what differs is how many
targets share a tick and when in the run they are measured: alternating the two phases in one
run tells which. Then `--cpu-requests` sequential requests per target (blocks alternated), with
each process's idle CPU rate subtracted: EPP (or floor processor) and Envoy CPU ms per request,
and minor page faults per request.

Not a test: run it by hand and record `uptime`.

    git archive 991405a src | tar -x -C /tmp/bb8-base
    .venv/bin/python scripts/big_bodies.py --variant main=/tmp/bb8-base/src --variant branch= \\
        --rounds 4 --seconds 10 --rate 5 --cpu-requests 100
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from poolkeeper.bench.live import live_processes as procs
from poolkeeper.bench.overhead import overhead_peers as peer
from poolkeeper.bench.overhead.overhead_floor import ENVOY, EXT_PROC_LEAN, floor_gateways
from poolkeeper.bench.overhead.overhead_gateway import (
    MODEL,
    SIM_CONFIG,
    body_of,
    cpu_seconds,
    wait_http,
    write_config,
)
from poolkeeper.netutil import free_ports

FLOOR = "floor lean"


async def pairs(
    direct: str, gateway: str, rate: float, seconds: float, data: bytes
) -> dict[str, float]:
    """`overhead_peers.interleaved` for two targets (the same schedule: a tick every 1/rate s,
    direct first in even ticks, the gateway first in odd ones), with the per-tick difference's
    p50 also split by which went first: after a tick's idle gap the first request of a tick
    may find the CPUs asleep, and only the pairs' shape puts each target first in every other
    tick."""
    n = max(1, int(rate * seconds))
    diffs: list[tuple[bool, float]] = []

    async def timed(session: aiohttp.ClientSession, url: str) -> float:
        return await peer.timed(session, url, data) * 1000

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def tick(i: int) -> None:
            if i % 2:
                g = await timed(session, gateway)
                d = await timed(session, direct)
            else:
                d = await timed(session, direct)
                g = await timed(session, gateway)
            diffs.append((bool(i % 2), g - d))

        await peer.paced(n, rate, tick)
    first = [d for g_first, d in diffs if g_first]
    second = [d for g_first, d in diffs if not g_first]
    return {
        "added": statistics.median(d for _, d in diffs),
        "gateway_first": statistics.median(first) if first else float("nan"),
        "direct_first": statistics.median(second) if second else float("nan"),
    }


def faults(pid: int) -> int:
    """Minor page faults of `pid` so far."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def serve_clocks(pid: int) -> dict[str, Callable[[], float]]:
    """The EPP (the serve process) and its Envoy (its child): CPU seconds and faults."""

    def envoy() -> int:
        kids = [k for k in peer.tree_pids(pid) if k != pid]
        return kids[0]

    return {
        "proc_cpu": lambda: cpu_seconds(pid),
        "envoy_cpu": lambda: cpu_seconds(envoy()),
        "proc_faults": lambda: float(faults(pid)),
        "envoy_faults": lambda: float(faults(envoy())),
    }


async def cpu_per_request(
    targets: dict[str, str],
    clocks: dict[str, dict[str, Callable[[], float]]],
    body: bytes,
    requests: int,
) -> dict[str, dict[str, float]]:
    """Sequential requests per target in 4 alternating blocks, idle rates subtracted."""

    def read() -> dict[str, dict[str, float]]:
        return {name: {k: f() for k, f in c.items()} for name, c in clocks.items()}

    r0, t0 = read(), time.perf_counter()
    await asyncio.sleep(5)
    r1, idle_s = read(), time.perf_counter() - t0
    idle = {n: {k: (r1[n][k] - r0[n][k]) / idle_s for k in r0[n]} for n in r0}
    used = {n: dict.fromkeys(clocks[n], 0.0) for n in clocks}
    block = max(1, requests // 4)
    async with aiohttp.ClientSession() as session:
        for b in range(4):
            names = list(clocks) if b % 2 == 0 else list(clocks)[::-1]
            for name in names:
                before, t = read()[name], time.perf_counter()
                for _ in range(block):
                    async with session.post(
                        targets[name], data=body, headers={"content-type": "application/json"}
                    ) as resp:
                        await resp.read()
                elapsed, after = time.perf_counter() - t, read()[name]
                for k in used[name]:
                    used[name][k] += after[k] - before[k] - idle[name][k] * elapsed
    n = 4 * block
    return {name: {k: v / n for k, v in u.items()} for name, u in used.items()}


async def run(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="big-bodies-"))
    (sim_port,) = free_ports(1)
    (tmp / "sim.yaml").write_text(SIM_CONFIG)
    # Every process runs through `live_processes.process` (own session, stopped at the end).
    stack = contextlib.ExitStack()
    poolkeeper = [sys.executable, "-m", "poolkeeper"]
    stack.enter_context(
        procs.process([*poolkeeper, "sim", "--count", "1", "--port", str(sim_port), "--model",
                      MODEL, "--max-num-seqs", "1024", "--config", str(tmp / "sim.yaml")],
                     tmp / "sim.log")
    )  # fmt: skip
    direct = f"http://127.0.0.1:{sim_port}/v1/chat/completions"
    targets: dict[str, str] = {"direct": direct}
    clocks: dict[str, dict[str, Callable[[], float]]] = {}
    serves: list[str] = []
    for spec in args.variant:
        name, _, path = spec.partition("=")
        (config := tmp / f"config-{name}").mkdir()
        ports = free_ports(5)
        write_config(config, sim_port, ports)
        proc = stack.enter_context(
            procs.process([*poolkeeper, "serve", "-f", str(config), "--workdir",
                          str(tmp / f"envoy-{name}"), "--log-level", "warning"],
                         tmp / f"serve-{name}.log", {"PYTHONPATH": path} if path else None)
        )  # fmt: skip
        targets[name] = f"http://127.0.0.1:{ports[0]}/v1/chat/completions"
        clocks[name] = serve_clocks(proc.pid)
        serves.append(name)
    body = body_of(args.prompt_bytes)
    data = json.dumps(body).encode()
    rounds: list[dict[str, Any]] = []
    try:
        with floor_gateways(tmp, sim_port, cpu_seconds) as floors:
            for name, label in ((ENVOY, "envoy"), (EXT_PROC_LEAN, FLOOR)):
                url, floor_clock = floors[name]
                targets[label] = url
                if label == FLOOR:
                    clocks[FLOOR] = {"proc_cpu": floor_clock["ext_proc"],
                                     "envoy_cpu": floor_clock["envoy"]}  # fmt: skip
            for url in targets.values():
                await wait_http(url)
            await peer.interleaved(targets, args.rate, 2.0, body)  # warm-up
            for r in range(args.rounds):
                for s in serves:
                    load = os.getloadavg()[0]
                    row = await pairs(direct, targets[s], args.rate, args.seconds, data)
                    rounds.append({"round": r, "phase": f"pairs {s}", "load": load,
                                   "added": {s: row["added"]}, "order": row})  # fmt: skip
                    print(f"round {r} pairs {s} (load {load:.1f}): {row['added']:.2f} "
                          f"(gateway first {row['gateway_first']:.2f}, direct first "
                          f"{row['direct_first']:.2f})", flush=True)  # fmt: skip
                load = os.getloadavg()[0]
                rows = await peer.interleaved(targets, args.rate, args.seconds, body)
                added = {k: v["added_p50"] for k, v in rows.items() if k != "direct"}
                rounds.append({"round": r, "phase": "interleaved", "load": load, "added": added})
                shown = "  ".join(f"{k} {v:.2f}" for k, v in added.items())
                print(f"round {r} interleaved (load {load:.1f}): {shown}", flush=True)
            cpu = {}
            if args.cpu_requests:
                cpu = await cpu_per_request(targets, clocks, data, args.cpu_requests)
    finally:
        stack.close()
    print("\n| target | size pairs: added p50 ms, median [min-max] | gateway first "
          "| direct first | interleaved |")  # fmt: skip
    print("|---|---|---|---|---|")
    for s in serves:
        mine = [x for x in rounds if x["phase"] == f"pairs {s}"]
        both = _spread([x["added"][s] for x in mine])
        gw = _spread([x["order"]["gateway_first"] for x in mine])
        dr = _spread([x["order"]["direct_first"] for x in mine])
        mixed = [x["added"][s] for x in rounds if x["phase"] == "interleaved"]
        print(f"| {s} | {both} | {gw} | {dr} | {_spread(mixed)} |")
    for other in ("envoy", FLOOR):
        mixed = [x["added"][other] for x in rounds if x["phase"] == "interleaved"]
        print(f"| {other} | - | - | - | {_spread(mixed)} |")
    print("\n| target | processor CPU ms/request | Envoy CPU ms/request | EPP faults/request "
          "| Envoy faults/request |")  # fmt: skip
    print("|---|---|---|---|---|")
    for name, c in cpu.items():
        print(f"| {name} | {c['proc_cpu'] * 1e3:.2f} | {c['envoy_cpu'] * 1e3:.2f} "
              f"| {c.get('proc_faults', float('nan')):.0f} "
              f"| {c.get('envoy_faults', float('nan')):.0f} |")  # fmt: skip
    if args.json:
        text = json.dumps({"rounds": rounds, "cpu": cpu}, indent=1)
        await asyncio.to_thread(Path(args.json).write_text, text)


def _spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", action="append", required=True,
                        help="NAME=[PYTHONPATH]: a serve from this tree or another")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=10.0, help="per phase")
    parser.add_argument("--rate", type=float, default=5.0, help="ticks per second")
    parser.add_argument("--prompt-bytes", type=int, default=1 << 20)
    parser.add_argument("--cpu-requests", type=int, default=100, help="per target; 0: none")
    parser.add_argument("--json", default="", help="also write the rounds here")
    args = parser.parse_args()
    names = [v.partition("=")[0] for v in args.variant]
    if any(not n or n in ("direct", "envoy", FLOOR) for n in names) or len(set(names)) < len(names):
        parser.error("--variant NAME=[PYTHONPATH]: distinct names, not direct/envoy/floor lean")
    if not 1 <= args.rounds <= 50 or not 0 < args.seconds <= 120 or not 0 < args.rate <= 50:
        parser.error("--rounds in [1, 50], --seconds in (0, 120], --rate in (0, 50]")
    if not 1 <= args.prompt_bytes <= 8 << 20 or not 0 <= args.cpu_requests <= 10_000:
        parser.error("--prompt-bytes in [1, 8 MiB], --cpu-requests in [0, 10000]")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
