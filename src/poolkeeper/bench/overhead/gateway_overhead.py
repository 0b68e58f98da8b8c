"""Latency the gateway adds (Envoy + EPP vs straight to a simulator), and EPP requests/s per core.

Starts one `poolkeeper sim` process (a fast, one-token simulator) and one `poolkeeper serve`
process (EPP + supervised Envoy) in front of it, all on 127.0.0.1. Then:

1. Added latency: at each request rate, an open-loop schedule of *pairs*: the same request sent
   straight to the simulator and through the gateway, in alternating order, one pair every
   1/rate seconds. Reported: p50 and p99 of each path, and of the per-pair difference.
   With `--prompt-bytes`, the same pairs at `--size-rate` for each prompt size (a user message
   of that many bytes of English-like text, one output token): what the gateway adds to large
   prompts (the body crosses Envoy, the ext_proc stream and the EPP's parser; the simulator
   does no per-token work on prompts, `SIM_CONFIG`, so its own cost stays a few ms).
2. EPP throughput: closed-loop clients (16 in flight) through the gateway for a few seconds;
   requests completed divided by the CPU seconds the EPP process used = requests/s per core.
3. The ext_proc layer alone: the same message pattern Envoy sends for one request (request
   headers + body, response headers, two response body chunks) from a gRPC client to the
   ext_proc server with a trivial router in a child process: requests per server CPU-second,
   i.e. the protocol's share of the EPP's cost.
4. With `--peers` and/or `--floor`: the same light load interleaved through vllm-router and
   sglang-router, and through Envoy alone and Envoy + a do-nothing Python ext_proc on grpc.aio
   and on the lean transport (`overhead_floor.py`), then a closed loop through each. With
   `--grpcio`, a second poolkeeper on the grpcio ext_proc transport joins the same rounds
   (the plain `poolkeeper` runs the default transport, lean).

Bounded (rates x duration, then a fixed closed-loop window) and local only. Not a test: run it
by hand and copy the printed Markdown into docs/benchmarks.md (## Gateway overhead).

    .venv/bin/python -m poolkeeper.bench.overhead.gateway_overhead --rates 10,50,100 --duration 10
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from poolkeeper.bench.overhead.overhead_gateway import (
    MODEL,
    SIM_CONFIG,
    body_of,
    start,
    wait_http,
    write_config,
)
from poolkeeper.bench.overhead.overhead_loads import (
    against_peers,
    closed_loop,
    idle_cpu_rate,
    paired,
    stream_cpu,
)
from poolkeeper.bench.overhead.overhead_protocol import protocol_only
from poolkeeper.errors import ConfigError
from poolkeeper.netutil import free_ports
from poolkeeper.scheduling.presets import PRESETS

PEERS = ("vllm-router", "sglang-router")


async def main(protocol_rate: float) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="10,50,100", help="request rates (pairs/s)")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per rate")
    parser.add_argument("--loop-seconds", type=float, default=10.0, help="closed-loop window")
    parser.add_argument("--clients", type=int, default=16, help="closed-loop clients")
    parser.add_argument(
        "--prompt-bytes", default="", help="prompt sizes for size pairs, e.g. 1024,65536,1048576"
    )
    parser.add_argument("--size-rate", type=float, default=5.0, help="pairs/s of size pairs")
    parser.add_argument(
        "--peers", default="", help="peer routers to compare, e.g. vllm-router,sglang-router"
    )
    parser.add_argument("--peer-rate", type=float, default=10.0, help="ticks/s with --peers")
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also through Envoy alone and Envoy + a do-nothing Python ext_proc "
        "(bench/overhead/overhead_floor.py), side by side with --peers",
    )
    parser.add_argument(
        "--grpcio",
        "--lean",  # the old spelling, from when grpcio was the plain row and lean the extra
        dest="grpcio",
        action="store_true",
        help="also a second poolkeeper with listeners.extProcTransport: grpcio, interleaved "
        "beside the first (the default, lean) in the comparison with --peers/--floor",
    )
    parser.add_argument(
        "--stream-tokens",
        default="",
        help="EPP and Envoy CPU per streamed request for these output lengths, e.g. 10,1000",
    )
    parser.add_argument(
        "--sim-time-scale",
        type=float,
        default=0.001,
        help="simulator speed (0.05 paces streamed tokens ~0.4 ms apart, as separate chunks)",
    )
    parser.add_argument(
        "--envoy-concurrency", type=int, default=1, help="Envoy worker threads (serve's flag)"
    )
    parser.add_argument(
        "--preset",
        default="default",
        choices=sorted(PRESETS),
        help="serve's scheduling preset (one that learns from first tokens, e.g. "
        "prefill-backlog, has Envoy report each stream's first byte)",
    )
    parser.add_argument(
        "--log-level",
        default="warning",
        choices=["debug", "info", "warning"],
        help="serve's log level (its log goes to a file): the cost of verbose logging",
    )
    args = parser.parse_args()
    peers = [p for p in args.peers.split(",") if p]
    if any(p not in PEERS for p in peers) or not 0 < args.peer_rate <= 100:
        parser.error(f"--peers takes {', '.join(PEERS)}; --peer-rate must be in (0, 100]")
    sizes = [int(b) for b in args.prompt_bytes.split(",") if b]
    if any(not 1 <= b <= 8 * 1024 * 1024 for b in sizes) or not 0 < args.size_rate <= 100:
        parser.error("--prompt-bytes must be in [1, 8 MiB] and --size-rate in (0, 100]")
    rates = [float(r) for r in args.rates.split(",") if r]
    tokens = [int(t) for t in args.stream_tokens.split(",") if t]
    if any(not 1 <= t <= 4096 for t in tokens) or not 0 < args.sim_time_scale <= 1:
        parser.error("--stream-tokens must be in [1, 4096] and --sim-time-scale in (0, 1]")
    if any(r <= 0 or r > 1000 for r in rates) or not 0 < args.duration <= 120:
        parser.error("rates must be in (0, 1000] and --duration in (0, 120]")
    if not 1 <= args.envoy_concurrency <= 64:
        parser.error("--envoy-concurrency must be in [1, 64]")

    tmp = Path(tempfile.mkdtemp(prefix="gateway-overhead-"))
    (config := tmp / "config").mkdir()
    sim_port, *ports = free_ports(6)
    write_config(config, sim_port, ports, args.preset)
    (tmp / "sim.yaml").write_text(SIM_CONFIG)
    sim = start(
        ["sim", "--count", "1", "--port", str(sim_port), "--model", MODEL, "--time-scale",
         str(args.sim_time_scale), "--max-num-seqs", "1024", "--config", str(tmp / "sim.yaml")],
        tmp / "sim.log",
    )  # fmt: skip
    serve = start(
        [
            "serve",
            "-f",
            str(config),
            "--workdir",
            str(tmp / "envoy"),
            "--log-level",
            args.log_level,
            "--envoy-concurrency",
            str(args.envoy_concurrency),
        ],
        tmp / "serve.log",
    )
    direct = f"http://127.0.0.1:{sim_port}/v1/chat/completions"
    gateway = f"http://127.0.0.1:{ports[0]}/v1/chat/completions"
    second: subprocess.Popen[bytes] | None = None
    if args.grpcio:
        (second_config := tmp / "config-grpcio").mkdir()
        second_ports = free_ports(5)
        write_config(second_config, sim_port, second_ports, args.preset, transport="grpcio")
        second = start(
            ["serve", "-f", str(second_config), "--workdir", str(tmp / "envoy-grpcio"),
             "--log-level", args.log_level, "--envoy-concurrency", str(args.envoy_concurrency)],
            tmp / "serve-grpcio.log",
        )  # fmt: skip
        args.second_gateway = (
            f"http://127.0.0.1:{second_ports[0]}/v1/chat/completions",
            second.pid,
        )
    try:
        await wait_http(direct)
        await wait_http(gateway)
        await paired(direct, gateway, 20, 1.0)  # warm-up
        rows = [(rate, await paired(direct, gateway, rate, args.duration)) for rate in rates]
        size_rows = [
            (b, await paired(direct, gateway, args.size_rate, args.duration, body_of(b)))
            for b in sizes
        ]
        loop = await closed_loop(gateway, serve.pid, args.loop_seconds, args.clients)
        idle = await idle_cpu_rate(serve.pid) if tokens else 0.0
        streamed = [
            (n, await stream_cpu(gateway, serve.pid, n, args.loop_seconds, idle)) for n in tokens
        ]
        if peers or args.floor or args.grpcio:
            compared = await against_peers(peers, tmp, sim_port, direct, gateway, serve.pid, args)
    finally:
        for p in (serve, sim, *([second] if second is not None else [])):
            p.terminate()
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
    cmd = " ".join(["python", *sys.argv])
    print(f"Command: `{cmd}`  ")
    print(
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}, {platform.system()} {platform.release()}; sim, EPP, "
        f"Envoy ({args.envoy_concurrency} worker) and the client share the machine.\n"
    )
    if rows:
        print("| rate (pairs/s) | pairs | direct p50 / p99 ms | gateway p50 / p99 ms "
              "| added p50 / p99 ms |")  # fmt: skip
        print("|---|---|---|---|---|")
        for rate, r in rows:
            print(
                f"| {rate:g} | {r['pairs']:.0f} | {r['direct_p50']:.2f} / {r['direct_p99']:.2f} "
                f"| {r['gateway_p50']:.2f} / {r['gateway_p99']:.2f} "
                f"| {r['added_p50']:.2f} / {r['added_p99']:.2f} |"
            )
    if size_rows:
        print(f"\nPrompt sizes, {args.size_rate:g} pairs/s, {args.duration:g} s each:\n")
        print("| prompt bytes | pairs | direct p50 / p99 ms | gateway p50 / p99 ms "
              "| added p50 / p99 ms |")  # fmt: skip
        print("|---|---|---|---|---|")
        for b, r in size_rows:
            print(
                f"| {b:,} | {r['pairs']:.0f} | {r['direct_p50']:.2f} / {r['direct_p99']:.2f} "
                f"| {r['gateway_p50']:.2f} / {r['gateway_p99']:.2f} "
                f"| {r['added_p50']:.2f} / {r['added_p99']:.2f} |"
            )
    print(
        f"\nClosed loop, {args.clients} clients, {args.loop_seconds:g} s: "
        f"{loop['rps']:.0f} requests/s through the gateway; the EPP process used "
        f"{loop['epp_cpu_s']:.2f} CPU-s for {loop['requests']:.0f} requests = "
        f"**{loop['per_core']:.0f} requests/s per EPP core**."
    )
    print(
        f"The ext_proc layer alone (grpcio, trivial router, 16 streams): {protocol_rate:.0f} "
        "requests per server CPU-second."
    )
    if streamed:
        print(
            f"\nStreamed responses (closed loop, 8 clients); the EPP's CPU with no traffic: "
            f"{idle * 1000:.1f} ms per second, subtracted in the last column:\n"
        )
        print(
            "| output tokens | requests | SSE events per response | EPP CPU ms per request "
            "| less idle | Envoy CPU ms per request |"
        )
        print("|---|---|---|---|---|---|")
        for n, r in streamed:
            print(
                f"| {n} | {r['requests']:.0f} | {r['events']:.0f} | {r['cpu_ms']:.2f} "
                f"| {r['net_cpu_ms']:.2f} | {r['envoy_cpu_ms']:.2f} |"
            )
    if peers or args.floor or args.grpcio:
        print("\n## Against the peer routers\n")
        print(compared)
    return 0


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):  # the usage needs no 20 s protocol measurement
        sys.exit(asyncio.run(main(0.0)))
    rate = protocol_only()  # before the event loop: it runs its own in a child process
    try:
        sys.exit(asyncio.run(main(rate)))
    except ConfigError as exc:  # e.g. a peer router that cannot start: one line, no traceback
        print(f"gateway_overhead: {exc}", file=sys.stderr)
        sys.exit(2)
