"""What the gateway overhead benchmark measures through the gateway, once it runs.

Pairs straight to the simulator and through the gateway (`paired`), the closed loop and its
requests per EPP CPU-second (`closed_loop`), the EPP's CPU with no traffic (`idle_cpu_rate`) and
per streamed request (`stream_cpu`), and the comparison with the peer routers and the floor
gateways (`against_peers`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import time
from pathlib import Path
from typing import Any

import aiohttp

from poolkeeper.bench.live import live_processes as procs, live_targets
from poolkeeper.bench.overhead import overhead_peers as peer
from poolkeeper.bench.overhead.overhead_floor import floor_gateways
from poolkeeper.bench.overhead.overhead_gateway import BODY, JSON, body_of, cpu_seconds, wait_http

GRPCIO = "poolkeeper (grpcio)"  # --grpcio: the second serve, on the grpcio ext_proc transport


async def paired(
    direct: str, gateway: str, rate: float, duration: float, body: dict[str, Any] | None = None
) -> dict[str, float]:
    """Direct and gateway in alternating order, one pair every 1/rate s (the two-target case
    of `overhead_peers.interleaved`)."""
    rows = await peer.interleaved(
        {"direct": direct, "gateway": gateway}, rate, duration, BODY if body is None else body
    )
    d, g = rows["direct"], rows["gateway"]
    return {
        "pairs": d["n"],
        "direct_p50": d["p50"], "direct_p99": d["p99"],
        "gateway_p50": g["p50"], "gateway_p99": g["p99"],
        "added_p50": g["added_p50"], "added_p99": g["added_p99"],
    }  # fmt: skip


async def closed_loop(gateway: str, epp_pid: int, seconds: float, clients: int) -> dict[str, float]:
    """Closed loop through the gateway: requests/s and requests per EPP CPU-second."""
    row = await peer.closed_loop(
        gateway, {"epp": lambda: cpu_seconds(epp_pid)}, seconds, clients, BODY
    )
    return {
        "requests": row["requests"], "rps": row["rps"], "epp_cpu_s": row["epp_cpu_s"],
        "per_core": row["epp_per_core"],
    }  # fmt: skip


async def idle_cpu_rate(epp_pid: int, seconds: float = 3.0) -> float:
    """The EPP's CPU-seconds per second with no traffic (scraping, health checks)."""
    cpu0 = cpu_seconds(epp_pid)
    await asyncio.sleep(seconds)
    return (cpu_seconds(epp_pid) - cpu0) / seconds


async def stream_cpu(
    gateway: str, epp_pid: int, tokens: int, seconds: float, idle_rate: float = 0.0
) -> dict[str, float]:
    """EPP CPU per streamed request of `tokens` output tokens (8 clients, closed loop):
    `cpu_ms` all of it, `net_cpu_ms` less the idle rate over the same time (long answers mean
    few requests, each of which would otherwise carry a large share of the background);
    `envoy_cpu_ms` Envoy's (serve's process tree less the EPP): the response observer's Lua
    filter runs on every streamed event there, out of sight of the EPP's CPU."""
    body = {**BODY, "max_tokens": tokens, "stream": True}
    data = json.dumps(body).encode()
    done = events = 0
    stop_at = time.perf_counter() + seconds
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def worker() -> None:
            nonlocal done, events
            while time.perf_counter() < stop_at:
                async with session.post(gateway, data=data, headers=JSON) as resp:
                    raw = await resp.read()
                    if resp.status != 200:
                        raise RuntimeError(f"{gateway}: HTTP {resp.status}")
                events += raw.count(b"data:")
                done += 1

        cpu0, tree0, t0 = cpu_seconds(epp_pid), peer.tree_cpu_seconds(epp_pid), time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(8)))
        cpu, elapsed = cpu_seconds(epp_pid) - cpu0, time.perf_counter() - t0
        envoy = peer.tree_cpu_seconds(epp_pid) - tree0 - cpu
    net = max(0.0, cpu - idle_rate * elapsed)
    return {
        "requests": done,
        "events": events / max(done, 1),
        "cpu_ms": cpu * 1000 / max(done, 1),
        "net_cpu_ms": net * 1000 / max(done, 1),
        "envoy_cpu_ms": envoy * 1000 / max(done, 1),
    }


async def against_peers(
    peers: list[str],
    tmp: Path,
    sim_port: int,
    direct: str,
    gateway: str,
    serve_pid: int,
    args: argparse.Namespace,
) -> str:
    """Start each peer (and with --floor the floor gateways) in front of the simulator;
    interleaved light load, then closed loops."""
    root = procs.repo_root()
    with contextlib.ExitStack() as stack:
        targets = {"direct": direct, "poolkeeper": gateway}
        cpu = {"poolkeeper": {"epp": lambda: cpu_seconds(serve_pid),
                              "epp+envoy": lambda: peer.tree_cpu_seconds(serve_pid)}}  # fmt: skip
        if args.grpcio:
            url, pid = args.second_gateway
            await wait_http(url)
            targets[GRPCIO] = url
            cpu[GRPCIO] = {"epp": functools.partial(cpu_seconds, pid),
                         "epp+envoy": functools.partial(peer.tree_cpu_seconds, pid)}  # fmt: skip
        if args.floor:
            for name, (url, clocks) in stack.enter_context(
                floor_gateways(tmp, sim_port, cpu_seconds)
            ).items():
                targets[name], cpu[name] = url, clocks
                await wait_http(url)
        for name in peers:
            cmd, port, ready = live_targets.router_command(name, root, tmp, [sim_port], [])
            pid = stack.enter_context(procs.process(cmd, tmp / f"{name}.log")).pid
            procs.wait_http(ready, lambda s: s == 200, 60, name)
            targets[name] = f"http://127.0.0.1:{port}/v1/chat/completions"
            cpu[name] = {"router": functools.partial(peer.tree_cpu_seconds, pid)}
            await wait_http(targets[name])
        await peer.interleaved(targets, 20, 1.0, BODY)  # warm-up
        light = await peer.interleaved(targets, args.peer_rate, args.duration, BODY)
        sections = [peer.latency_table(light, args.peer_rate)]
        for size in [int(b) for b in args.prompt_bytes.split(",") if b]:
            rows = await peer.interleaved(targets, args.size_rate, args.duration, body_of(size))
            sections.append(f"\nPrompt of {size:,} bytes:\n")
            sections.append(peer.latency_table(rows, args.size_rate))
        loops = {
            name: await peer.closed_loop(
                targets[name], cpu[name], args.loop_seconds, args.clients, BODY
            )
            for name in targets
            if name != "direct"
        }
        sections.append("\n" + peer.loop_table(loops, args.clients, args.loop_seconds))
    return "\n".join(sections)
