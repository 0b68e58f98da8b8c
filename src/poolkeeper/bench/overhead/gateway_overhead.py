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
import contextlib
import functools
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from poolkeeper.bench.live import live
from poolkeeper.bench.overhead import overhead_peers as peer
from poolkeeper.bench.overhead.overhead_floor import floor_gateways
from poolkeeper.errors import ConfigError
from poolkeeper.netutil import free_ports
from poolkeeper.scheduling.presets import PRESETS

PEERS = ("vllm-router", "sglang-router")
GRPCIO = "poolkeeper (grpcio)"  # --grpcio: the second serve, on the grpcio ext_proc transport

MODEL = "bench-model"
BODY: dict[str, Any] = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 1,
}
JSON = {"content-type": "application/json"}
_WORDS = "the quick brown fox jumps over the lazy dog while a model server answers "


def body_of(prompt_bytes: int) -> dict[str, Any]:
    """The benchmark request with a user message of `prompt_bytes` bytes (1 output token)."""
    text = (_WORDS * (prompt_bytes // len(_WORDS) + 1))[:prompt_bytes]
    return {**BODY, "messages": [{"role": "user", "content": text}]}


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def write_config(
    directory: Path,
    sim_port: int,
    ports: list[int],
    preset: str = "default",
    transport: str = "lean",
    *,
    observe_responses: bool = False,
    max_connections_per_client: int | None = None,
) -> None:
    """The benchmark gateway over one simulator (also scripts/route_profile.py's, which turns
    the response observer on as the Envoy `serve` runs have it, without running Envoy, and
    scripts/conncap_cost.py's, which sets the per-client connection cap)."""
    http, ext_proc, metrics, health, admin = ports
    edge_keys = ["observeResponses: true"] if observe_responses else []
    if max_connections_per_client is not None:
        edge_keys.append(f"maxConnectionsPerClient: {max_connections_per_client}")
    edge = f"  edge: {{{', '.join(edge_keys)}}}\n" if edge_keys else ""
    (directory / "gateway.yaml").write_text(f"""\
apiVersion: poolkeeper.dev/v1alpha1
kind: GatewayConfig
metadata: {{name: bench}}
spec:
  listeners: {{http: {http}, extProc: {ext_proc}, metrics: {metrics}, health: {health},
    admin: {admin}, extProcTransport: {transport}}}
{edge}  scraping: {{intervalMs: 50}}
  scheduling: {{preset: {preset}}}
  endpoints:
    - {{name: sim-0, address: 127.0.0.1, port: {sim_port}, labels: {{app: bench}}}}
---
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferencePool
metadata: {{name: bench, namespace: default}}
spec:
  selector: {{app: bench}}
  targetPortNumber: 8000
  extensionRef: {{name: bench-epp}}
---
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceModel
metadata: {{name: bench, namespace: default}}
spec: {{modelName: {MODEL}, criticality: Critical, poolRef: {{name: bench}}}}
""")


async def wait_http(url: str, within_s: float = 120) -> None:  # startup on a loaded machine
    deadline = time.monotonic() + within_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            try:
                async with session.post(url, json=BODY) as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise TimeoutError(url)


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


# The simulator behind every row, direct and gateway alike: a context long enough for the
# largest prompt (1 MB of text is ~262k tokens), and no per-token prompt work (no prefix-cache
# hashing, no prefill time, any prompt in one step of one KV block), so that a 1 MB prompt
# costs it a few ms (its JSON parse) rather than ~300 ms of hashing and chunked prefill, and
# the 1 MB rows measure the gateway. Output tokens keep their pace (`--sim-time-scale`).
SIM_CONFIG = (
    "defaults: {max_model_len: 2500000, num_gpu_blocks: 4000, block_size: 65536,\n"
    "  enable_prefix_caching: false, prefill_token_s: 0, max_num_batched_tokens: 3000000}\n"
)


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
    few requests, each of which would otherwise carry a large share of the background)."""
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

        cpu0, t0 = cpu_seconds(epp_pid), time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(8)))
        cpu, elapsed = cpu_seconds(epp_pid) - cpu0, time.perf_counter() - t0
    net = max(0.0, cpu - idle_rate * elapsed)
    return {
        "requests": done,
        "events": events / max(done, 1),
        "cpu_ms": cpu * 1000 / max(done, 1),
        "net_cpu_ms": net * 1000 / max(done, 1),
    }


class _TrivialRouter:
    """Always the same endpoint; no parsing: isolates the ext_proc layer's own cost."""

    async def route(self, request: Any) -> Any:
        from poolkeeper.requestcontrol.types import RoutingDecision

        return RoutingDecision(request.request_id, ("127.0.0.1:1",), "default/p", "m", "m")

    def complete(
        self, decision: Any, *, status: int, usage: Any, served_endpoint: Any = None
    ) -> None:
        pass

    def served(self, decision: Any, endpoint: str) -> None:
        pass

    def first_byte(self, decision: Any, *, after_s: float | None = None) -> None:
        pass

    def model_names(self) -> list[str]:
        return ["m"]

    def ready(self) -> bool:
        return True


def _protocol_server(port_queue: Any) -> None:
    from poolkeeper.extproc.server import ExtProcServicer, build_server

    async def run() -> None:
        server, port = build_server(ExtProcServicer(_TrivialRouter()), "127.0.0.1:0")
        await server.start()
        port_queue.put(port)
        await asyncio.sleep(3600)

    asyncio.run(run())


async def _protocol_client(port: int, n: int, concurrency: int) -> None:
    import grpc
    from envoy.config.core.v3 import base_pb2
    from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
    from envoy.service.ext_proc.v3 import (
        external_processor_pb2 as pb,
        external_processor_pb2_grpc as pb_grpc,
    )

    def headers(values: dict[str, str], *, response: bool = False) -> Any:
        hs = pb.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[
                    base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()
                ]
            )
        )
        if response:
            return pb.ProcessingRequest(response_headers=hs)
        req = pb.ProcessingRequest(request_headers=hs)
        req.protocol_config.request_body_mode = pm.ProcessingMode.FULL_DUPLEX_STREAMED
        req.protocol_config.response_body_mode = pm.ProcessingMode.FULL_DUPLEX_STREAMED
        return req

    def body(data: bytes, eos: bool, *, response: bool = False) -> Any:
        b = pb.HttpBody(body=data, end_of_stream=eos)
        return (
            pb.ProcessingRequest(response_body=b)
            if response
            else pb.ProcessingRequest(request_body=b)
        )

    request_headers = headers({":method": "POST", ":path": "/v1/chat/completions"})
    request_body = body(json.dumps(BODY).encode(), True)
    response_headers = headers(
        {":status": "200", "content-type": "application/json"}, response=True
    )
    usage = json.dumps({"usage": {"prompt_tokens": 1, "completion_tokens": 1}}).encode()
    semaphore = asyncio.Semaphore(concurrency)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)

        async def one() -> None:
            async with semaphore:
                call = stub.Process()
                await call.write(request_headers)
                await call.write(request_body)
                await call.read()
                await call.read()
                await call.write(response_headers)
                await call.read()
                await call.write(body(usage, False, response=True))
                await call.read()
                await call.write(body(b"", True, response=True))
                await call.read()
                await call.done_writing()
                await call.read()

        await asyncio.gather(*(one() for _ in range(n)))


def protocol_only(n: int = 3000, concurrency: int = 16) -> float:
    """Requests per CPU-second of an ext_proc server with a trivial router."""
    import multiprocessing

    queue: Any = multiprocessing.Queue()
    child = multiprocessing.Process(target=_protocol_server, args=(queue,), daemon=True)
    child.start()
    try:
        port = queue.get(timeout=30)
        asyncio.run(_protocol_client(port, 300, concurrency))  # warm-up
        assert child.pid is not None
        cpu0 = cpu_seconds(child.pid)
        asyncio.run(_protocol_client(port, n, concurrency))
        return n / (cpu_seconds(child.pid) - cpu0)
    finally:
        child.kill()
        child.join(5)


def start(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    """`poolkeeper ARGS` in a session of its own, as the peers and the floor's processors run
    (`live.process`): with the kernel's autogroup scheduling each session gets an equal share
    of a busy machine, so in its caller's session a `serve` would share one with this
    driver, its clients and the simulator while each peer had one to itself."""
    return subprocess.Popen(
        [sys.executable, "-m", "poolkeeper", *args],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


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
        help="EPP CPU per streamed request for these output lengths, e.g. 10,1000",
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
            "| less idle |"
        )
        print("|---|---|---|---|---|")
        for n, r in streamed:
            print(
                f"| {n} | {r['requests']:.0f} | {r['events']:.0f} | {r['cpu_ms']:.2f} "
                f"| {r['net_cpu_ms']:.2f} |"
            )
    if peers or args.floor or args.grpcio:
        print("\n## Against the peer routers\n")
        print(compared)
    return 0


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
    root = live.repo_root()
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
            cmd, port, ready = live.router_command(name, root, tmp, [sim_port], [])
            pid = stack.enter_context(live.process(cmd, tmp / f"{name}.log")).pid
            live.wait_http(ready, lambda s: s == 200, 60, name)
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


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):  # the usage needs no 20 s protocol measurement
        sys.exit(asyncio.run(main(0.0)))
    rate = protocol_only()  # before the event loop: it runs its own in a child process
    try:
        sys.exit(asyncio.run(main(rate)))
    except ConfigError as exc:  # e.g. a peer router that cannot start: one line, no traceback
        print(f"gateway_overhead: {exc}", file=sys.stderr)
        sys.exit(2)
