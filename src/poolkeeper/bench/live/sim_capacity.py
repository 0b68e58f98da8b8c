"""How many concurrent streams one simulator process sustains, and how much it distorts latency.

Starts `poolkeeper sim --count S` as a subprocess pinned to one CPU core, then drives N
closed-loop streaming clients (this process, pinned to another core) round-robin across the S
servers. For each N it compares what clients measure with what the engine model says the
latencies are (the servers' own model-time histograms over the same window):

    e2e distortion = client mean end-to-end / model mean end-to-end - 1
    ttft overhead  = client mean TTFT - model mean TTFT (ms)

plus the simulator's CPU use and the driver's delivery lag. Not a test: run it by hand and copy
the table into docs/benchmarks.md (## Simulator capacity).

    .venv/bin/python -m poolkeeper.bench.live.sim_capacity --servers 16 --streams 250,500,1000 \
        --duration 20

`--virtual` instead times the virtual-time fleet (no sockets): `--servers` engines, Poisson
arrivals at `--rate` requests/s for `--duration` virtual seconds, routed at random.

The clients and the readings are `sim_capacity_load.py`'s; this module runs them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import statistics
import sys
import time
from typing import Any

import aiohttp

from poolkeeper.bench.live.sim_capacity_load import Window, client_loop, cpu_seconds, sim_stats
from poolkeeper.netutil import free_ports

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


async def measure(args: argparse.Namespace, streams: int) -> dict[str, Any]:
    port = free_ports(args.servers, consecutive=True)[0]
    cmd = [sys.executable, "-m", "poolkeeper.cli.sim", "--count", str(args.servers),
           "--port", str(port), "--time-scale", str(args.time_scale),
           "--stream-interval", str(args.stream_interval)]  # fmt: skip
    sim_core, client_cores = {0}, set(range(1, os.cpu_count() or 2)) or {0}

    def pin_sim() -> None:
        os.sched_setaffinity(0, sim_core)

    proc = await asyncio.create_subprocess_exec(
        *cmd,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        preexec_fn=pin_sim if args.pin else None,
    )
    if args.pin:
        os.sched_setaffinity(0, client_cores)
    assert proc.stdout is not None
    try:
        async with asyncio.timeout(30):
            while not (await proc.stdout.readline()).startswith(b"serving"):
                pass
        urls = [f"http://127.0.0.1:{port + i}" for i in range(args.servers)]
        loop = asyncio.get_running_loop()
        now = loop.time()
        window = Window(now + args.warmup, now + args.warmup + args.duration)
        window.max_tokens = args.max_tokens
        prompt = "@@ " + ("benchmark prompt text " * 200)[: args.prompt_chars]
        body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": args.max_tokens,
                           "stream": True}).encode()  # fmt: skip
        async with aiohttp.ClientSession() as http:
            stop_at = window.end
            tasks = [
                asyncio.create_task(
                    client_loop("127.0.0.1", port + i % args.servers, body, stop_at, window)
                )
                for i in range(streams)
            ]
            await asyncio.sleep(max(0.0, window.start - loop.time()))
            cpu_before, wall_before = cpu_seconds(proc.pid), time.monotonic()
            before = await sim_stats(http, urls)
            if loop.time() > window.start + 0.2 * args.duration:
                print(f"# {streams} streams: stats took {loop.time() - window.start:.1f}s: "
                      "the machine is overloaded, numbers are unreliable")  # fmt: skip
            await asyncio.sleep(max(0.0, window.end - loop.time()))
            cpu_after, wall_after = cpu_seconds(proc.pid), time.monotonic()
            after = await sim_stats(http, urls)
            await asyncio.gather(*tasks)
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGINT)
        await proc.communicate()
    model_e2e = (after["e2e_sum"] - before["e2e_sum"]) / max(
        1, after["e2e_count"] - before["e2e_count"]
    )
    model_ttft = (after["ttft_sum"] - before["ttft_sum"]) / max(
        1, after["ttft_count"] - before["ttft_count"]
    )
    model_itl = (after["itl_sum"] - before["itl_sum"]) / max(
        1, after["itl_count"] - before["itl_count"]
    )
    client_e2e = statistics.mean(window.e2e) if window.e2e else float("nan")
    client_ttft = statistics.mean(window.ttft) if window.ttft else float("nan")
    return {
        "streams": streams,
        "completed": len(window.e2e),
        "errors": window.errors,
        "tokens_per_s": window.tokens / args.duration,
        "sim_cpu": (cpu_after - cpu_before) / (wall_after - wall_before),
        "model_e2e_ms": model_e2e * 1000,
        "client_e2e_ms": client_e2e * 1000,
        "e2e_distortion_pct": (client_e2e / model_e2e - 1) * 100,
        "model_ttft_ms": model_ttft * 1000,
        "ttft_overhead_ms": (client_ttft - model_ttft) * 1000,
        "model_itl_ms": model_itl * 1000,
        "lag_mean_ms": (after["lag_sum"] - before["lag_sum"])
        / max(1, after["lag_steps"] - before["lag_steps"]) * 1000,
        "cpu_us_per_token": (cpu_after - cpu_before) / (wall_after - wall_before)
        / max(1.0, window.tokens / args.duration) * 1e6,
    }  # fmt: skip


def run_virtual(args: argparse.Namespace) -> None:
    import random

    from poolkeeper.sim.params import EngineConfig
    from poolkeeper.sim.virtual import VirtualFleet
    from poolkeeper.sim.virtual_results import Arrival

    rng = random.Random(0)
    prefixes = [f"system prompt {i} " * 40 for i in range(50)]

    def arrivals() -> Any:
        t, i = 0.0, 0
        while True:
            t += rng.expovariate(args.rate)
            if t >= args.duration:
                return
            i += 1
            prompt = rng.choice(prefixes) + f"question {i} " * 10
            yield Arrival(t, f"r{i}", MODEL, prompt, max_tokens=rng.randint(50, 300))

    fleet = VirtualFleet([EngineConfig()] * args.servers, seed=1)
    started = time.perf_counter()
    result = fleet.run(arrivals(), lambda a, states, now: rng.randrange(len(states)))
    wall = time.perf_counter() - started
    summary = result.summary()
    tokens = sum(r.completion_tokens for r in result.requests)
    print(
        f"| {args.servers} | {args.rate:g} | {args.duration:g} | {len(result.requests)} | "
        f"{tokens} | {wall:.1f} | {args.duration / wall:.1f} | {summary['ttft_p50'] * 1000:.1f} | "
        f"{summary['e2e_p50']:.2f} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--servers", type=int, default=16)
    parser.add_argument("--streams", default="250,500,1000")
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--prompt-chars", type=int, default=1000)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--stream-interval", type=int, default=1)
    parser.add_argument(
        "--pin",
        action="store_true",
        help="pin the simulator to CPU 0 and the clients to the others (on a quiet machine)",
    )
    parser.add_argument("--virtual", action="store_true", help="time the virtual-time fleet")
    parser.add_argument("--rate", type=float, default=500.0, help="--virtual: requests/s")
    args = parser.parse_args()
    if args.virtual:
        print("| servers | req/s | virtual s | requests | output tokens | wall s | "
              "virtual s per wall s | TTFT p50 ms | e2e p50 s |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|")
        run_virtual(args)
        return 0
    machine = f"{platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    print(
        f"# {machine}; {args.servers} servers, time-scale {args.time_scale}, "
        f"stream-interval {args.stream_interval}, pinned {args.pin}, "
        f"max_tokens {args.max_tokens}, prompt {args.prompt_chars} chars, "
        f"window {args.duration}s after {args.warmup}s"
    )
    columns = ["streams", "completed", "errors", "tokens_per_s", "sim_cpu", "model_e2e_ms",
               "client_e2e_ms", "e2e_distortion_pct", "model_ttft_ms", "ttft_overhead_ms",
               "model_itl_ms", "lag_mean_ms", "cpu_us_per_token"]  # fmt: skip
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for streams in (int(s) for s in args.streams.split(",")):
        row = asyncio.run(measure(args, streams))
        cells = [f"{row[c]:.3g}" if isinstance(row[c], float) else str(row[c]) for c in columns]
        print("| " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
