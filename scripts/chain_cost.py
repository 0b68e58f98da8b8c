"""What each part of `serve`'s per-request Envoy chain costs: `serve` variants side by side.

Starts one simulator (`overhead_gateway.SIM_CONFIG`) and one `poolkeeper serve` per
`--variant NAME=DROP[@PYTHONPATH]`, each with its own EPP and Envoy, where DROP names the parts
taken out of that serve's bootstrap (comma-separated: `lua` the response observer's Lua filter,
`resp` the response processor, `als` the gRPC access log, `early` the early header mutation;
features, for measurement only: `retry`, `routes`, `hcmopts`, `overload` (see FEATURES);
empty: the bootstrap as shipped), or parts of the EPP (`director`: the scheduler replaced by a
replayed decision; `canned`: a servicer that answers every stream with `serve`'s replies and
decides nothing, and with it `nometa`, `nokey`, `nocl`: those replies without their dynamic
metadata, exchange key, content-length; see `_patch_epp`) and PYTHONPATH, when given, runs
that serve from another tree
(e.g. a `git archive` of main's `src/`: an A/B of two commits). Optionally the `--floor`
gateways and `--peers` join. Then rounds of interleaved light load (every target once per tick,
the order rotated, `overhead_peers.interleaved`) and, per serve, the EPP's and its Envoy's CPU
per request over all rounds, and the EPP's garbage-collector passes after start-up (count and
total ms per generation). `--timing` adds, per gateway (serves and floors), Envoy's own clock
per request (an access log: request start to the first byte upstream, ext_proc's latency of
the headers message, the response path) and, per serve, the EPP's wall and loop-thread CPU
from a stream's HEADERS to its trailers; `--profile` a cProfile of each serve's EPP.

Taking a part out breaks what it provides (no access log: requests never complete in the EPP's
accounting), so a variant is a measurement, never a configuration. Not a test: run it by hand,
and record `uptime`: on a shared host only differences inside one run mean much.

    .venv/bin/python scripts/chain_cost.py --variant shipped= --variant no-lua=lua \\
        --variant none=lua,resp,als --floor --peers sglang-router --rounds 8 --seconds 15
    .venv/bin/python scripts/chain_cost.py --variant serve= --variant director=director \
        --variant canned=canned --variant canned-nometa=canned,nometa --floor --timing
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

DROPS = {
    "lua": "envoy.filters.http.lua",
    "resp": "poolkeeper.response_processor",
}
# What a variant may take out of the EPP rather than the bootstrap (`_patch_epp`).
EPP_DROPS = {"director", "canned", "nometa", "nokey", "nocl", "noclear", "late"}
# Bootstrap parts that are features, not optional filters (measurements only): `retry` the
# routed routes' retry policy and retry buffer, `routes` every route but the inference ones
# (CONNECT, 413, 415, 405, 404), `hcmopts` the connection manager's path normalisation and
# request timeouts, `overload` the overload manager.
FEATURES = {"retry", "routes", "hcmopts", "overload"}
# The EPP's configuration (measurements only): `scrape1s` scrapes the simulator's metrics every
# second rather than every 50 ms (GIE's interval, the benchmark's): what the EPP's background
# work, ~20 scrapes a second, costs a request it does not overlap (caches, wake-ups).
CONFIG_PARTS = {"scrape1s"}
PARTS = {"lua", "resp", "als", "early", *FEATURES, *EPP_DROPS, *CONFIG_PARTS}
# Envoy's own clock per request (a file access log each gateway writes when asked, --timing):
# request start to the first byte sent upstream (the request path: ext_proc and routing), the
# upstream's answer, the response path, and ext_proc's own latency of the headers message (in
# FULL_DUPLEX_STREAMED mode: headers sent to their reply, which waits for the body's routing).
TIMING_FORMAT = (
    "%COMMON_DURATION(DS_RX_BEG:US_TX_BEG:us)% "
    "%COMMON_DURATION(DS_RX_END:US_TX_BEG:us)% "
    "%COMMON_DURATION(US_TX_BEG:US_RX_BEG:us)% "
    "%COMMON_DURATION(US_RX_END:DS_TX_END:us)% "
    "%COMMON_DURATION(DS_RX_BEG:DS_TX_END:us)% "
    "%FILTER_STATE(envoy.filters.http.ext_proc:FIELD:request_header_latency_us)% "
    "%FILTER_STATE(envoy.filters.http.ext_proc:FIELD:request_body_total_latency_us)% "
    "%RESPONSE_CODE%\n"
)
TIMING_FIELDS = ("to_upstream", "body_to_upstream", "upstream", "response_path", "total",
                 "ext_proc_headers", "ext_proc_body")  # fmt: skip


def timing_log(path: str) -> dict[str, Any]:
    return {
        "name": "envoy.access_loggers.file",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
            "path": path,
            "log_format": {"text_format_source": {"inline_string": TIMING_FORMAT}},
        },
    }


# -- inside each serve variant ------------------------------------------------------------------


def _without(node: Any, names: set[str]) -> None:
    """Remove per-route configs of the dropped filters (Envoy refuses them for absent ones)."""
    if isinstance(node, dict):
        per_route = node.get("typed_per_filter_config")
        if isinstance(per_route, dict):
            for name in names:
                per_route.pop(name, None)
            if not per_route:
                del node["typed_per_filter_config"]
        for value in node.values():
            _without(value, names)
    elif isinstance(node, list):
        for value in node:
            _without(value, names)


def _gc_log(path: str) -> None:
    """Time every collection once start-up is over (serve's freeze, or 60 s for a tree without
    it); write the totals at exit."""
    totals = {0: [0, 0.0], 1: [0, 0.0], 2: [0, 0.0]}
    began = [0.0]

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            entry = totals[info["generation"]]
            entry[0] += 1
            entry[1] += time.perf_counter() - began[0]

    def reset() -> None:  # once serve froze start-up's objects (after its own full pass)
        deadline = time.monotonic() + 60
        while not gc.get_freeze_count() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(0.5)
        for entry in totals.values():
            entry[:] = [0, 0.0]

    gc.callbacks.append(callback)
    threading.Thread(target=reset, daemon=True).start()

    import atexit

    def write() -> None:
        passes = {g: (n, round(s * 1000, 1)) for g, (n, s) in totals.items()}
        Path(path).write_text(f"{passes} frozen={gc.get_freeze_count()}\n")

    atexit.register(write)


def _epp_times(path: str) -> None:
    """Per stream, from the last request DATA frame read to the stream's trailers (its replies
    written with them): wall and the loop thread's CPU, in us. Wall minus CPU is time the EPP
    held the request without running (other tasks, the GIL, the host's scheduler)."""
    import atexit

    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    from poolkeeper.extproc.h2.connection import Connection
    from poolkeeper.extproc.wire import read_request

    # The Process method's decoders: serve's (wire.read_request) and the floor processor's.
    process_streams = (pb.ProcessingRequest.FromString, read_request)
    marks: dict[tuple[int, int], list[int]] = {}
    out: list[tuple[int, int, int, int]] = []
    on_data, open_, finish = Connection._on_data, Connection._open, Connection._finish

    def _open(self: Any, stream_id: int, end_stream: bool, headers: Any) -> None:
        now = [time.perf_counter_ns(), time.thread_time_ns()]
        marks[(id(self), stream_id)] = now + now
        open_(self, stream_id, end_stream, headers)

    def _on_data(self: Any, flags: int, stream_id: int, payload: memoryview) -> None:
        mark = marks.get((id(self), stream_id))
        if mark is not None:
            mark[2:] = time.perf_counter_ns(), time.thread_time_ns()
        on_data(self, flags, stream_id, payload)

    def _finish(self: Any, stream: Any, code: int, message: str | None) -> None:
        mark = marks.pop((id(self), stream.id), None)
        finish(self, stream, code, message)
        ours = stream.inbox is not None and stream.inbox._decode in process_streams
        if mark is not None and ours and len(out) < 200_000:
            wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
            out.append(((wall - mark[2]) // 1000, (cpu - mark[3]) // 1000,
                        (wall - mark[0]) // 1000, (cpu - mark[1]) // 1000))  # fmt: skip

    Connection._on_data, Connection._finish = _on_data, _finish  # type: ignore[method-assign]
    Connection._open = _open  # type: ignore[method-assign]

    def write() -> None:
        Path(path).write_text(json.dumps(out))

    atexit.register(write)


def _profile(path: str) -> None:
    """cProfile of the EPP's loop thread from its first ext_proc stream to exit (the profiler
    inflates every call: read the shares), its top functions written at exit."""
    import atexit
    import cProfile
    import io
    import pstats

    from poolkeeper.extproc.h2.connection import Connection

    profiler = cProfile.Profile()
    open_ = Connection._open
    started = [False]

    def _open(self: Any, stream_id: int, end_stream: bool, headers: Any) -> None:
        if not started[0]:
            started[0] = True
            profiler.enable()
        open_(self, stream_id, end_stream, headers)

    Connection._open = _open  # type: ignore[method-assign]

    def write() -> None:
        profiler.disable()
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("tottime").print_stats(45)
        stats.sort_stats("cumulative").print_stats(60)
        Path(path).write_text(text.getvalue())

    atexit.register(write)


class _Replay:
    """The Director's first decision given again to every later request: the EPP's path (the
    Exchange, its replies, the transport) without the Director and the scheduler."""

    def __init__(self, router: Any) -> None:
        self._router = router
        self._decision: Any = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._router, name)

    async def route(self, request: Any) -> Any:
        if self._decision is None:
            self._decision = await self._router.route(request)
        return self._decision

    def complete(self, *args: Any, **kwargs: Any) -> None:
        pass

    def first_byte(self, *args: Any, **kwargs: Any) -> None:
        pass

    def served(self, *args: Any, **kwargs: Any) -> None:
        pass


def _patch_epp(drop: set[str]) -> None:
    """`late`: the request path's metric samples 20 ms after the reply rather than right after
    it. `director`: the scheduler replaced by a replayed decision (`_Replay`). `canned`: the
    servicer replaced by one that answers each stream with `serve`'s replies for it (the
    destination and content-length headers, the route-cache clear, `envoy.lb` and the exchange
    key in metadata, the body streamed back) and decides nothing; with `nometa` (no dynamic
    metadata: override_host reads the header), `nokey` (no exchange key), `nocl` (no
    content-length), `noclear` (no route-cache clear: only meaningful where the route does
    not need it) taken out of those replies."""
    from poolkeeper.extproc import messages as msg, routing_replies
    from poolkeeper.extproc.server import ExtProcServicer

    if "late" in drop:
        from poolkeeper.telemetry.metrics import GatewayMetrics

        defer = GatewayMetrics.defer_request_path

        def later(self: Any, schedule: Any) -> None:
            loop = asyncio.get_running_loop()
            defer(self, lambda callback: loop.call_later(0.02, callback))

        GatewayMetrics.defer_request_path = later  # type: ignore[method-assign]
    init = ExtProcServicer.__init__

    def __init__(self: Any, router: Any, **kwargs: Any) -> None:
        init(self, _Replay(router) if "director" in drop or "canned" in drop else router,
             **kwargs)  # fmt: skip

    ExtProcServicer.__init__ = __init__  # type: ignore[method-assign]
    if "canned" not in drop:
        return
    import uuid

    process = ExtProcServicer.Process

    async def canned(self: Any, requests: Any, context: Any = None) -> Any:
        replay = self.router
        if replay._decision is None:  # the first request decides, for real
            async for reply in process(self, requests, context):
                yield reply
            return
        endpoints = replay._decision.endpoints
        body: list[bytes] = []
        async for request in requests:
            kind = request.WhichOneof("request")
            if kind == "request_body":
                body.append(request.request_body.body)
                if not request.request_body.end_of_stream:
                    continue
            elif kind != "request_headers" or not request.request_headers.end_of_stream:
                continue
            data = b"".join(body)
            metadata = None
            if "nometa" not in drop:
                metadata = routing_replies.destination_metadata(endpoints)
                if "nokey" not in drop:
                    routing_replies.add_exchange_key(metadata, uuid.uuid4().hex, via_epp=False)
            length = None if "nocl" in drop else len(data)
            mutation = routing_replies.routing_headers(endpoints, length, [])
            yield msg.request_headers_reply(
                mutation, clear_route_cache="noclear" not in drop, metadata=metadata
            )
            for reply in msg.streamed_body_replies(data, end_of_stream=True):
                yield reply
            return

    ExtProcServicer.Process = canned  # type: ignore[method-assign,assignment]


def _scrape_every_second(config: Path) -> None:
    """`scrape1s`: the written gateway's metrics interval from 50 ms to 1 s."""
    for path in config.iterdir():
        text = path.read_text()
        if "intervalMs: 50}" in text:
            path.write_text(text.replace("intervalMs: 50}", "intervalMs: 1000}"))
            return
    raise SystemExit(f"scrape1s: no 'intervalMs: 50' in {config}")


def serve_variant(drop: set[str], argv: list[str]) -> int:
    """`poolkeeper serve ARGV` with the parts in `drop` taken out of its bootstrap."""
    if os.environ.get("CHAIN_COST_GC_LOG"):
        _gc_log(os.environ["CHAIN_COST_GC_LOG"])
    if os.environ.get("CHAIN_COST_EPP_TIMES"):
        _epp_times(os.environ["CHAIN_COST_EPP_TIMES"])
    if drop & EPP_DROPS:
        _patch_epp(drop & EPP_DROPS)
    if os.environ.get("CHAIN_COST_PROFILE"):
        _profile(os.environ["CHAIN_COST_PROFILE"])
    import poolkeeper.envoy.bootstrap as bootstrap  # before the CLI imports it by name

    shipped = bootstrap.build_bootstrap

    def build(params: Any) -> dict[str, Any]:
        config = shipped(params)
        listener = config["static_resources"]["listeners"][0]
        hcm = listener["filter_chains"][0]["filters"][-1]["typed_config"]
        names = {DROPS[d] for d in drop if d in DROPS}
        hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] not in names]
        _without(hcm, names)
        if "als" in drop:
            kept = [x for x in hcm.get("access_log", []) if "http_grpc" not in x["name"]]
            hcm.pop("access_log", None)
            if kept:
                hcm["access_log"] = kept
        if "early" in drop:
            hcm.pop("early_header_mutation_extensions", None)
        routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
        if "retry" in drop:
            for route in routes:
                route.get("route", {}).pop("retry_policy", None)
                if "route" in route:
                    route.pop("per_request_buffer_limit_bytes", None)
        if "routes" in drop:
            hcm["route_config"]["virtual_hosts"][0]["routes"] = [
                r for r in routes if "route" in r or r["name"].startswith("not_routed")
            ]
        if "hcmopts" in drop:
            for key in ("normalize_path", "merge_slashes", "path_with_escaped_slashes_action",
                        "request_timeout", "request_headers_timeout"):  # fmt: skip
                hcm.pop(key, None)
        if "overload" in drop:
            config.pop("overload_manager", None)
        if os.environ.get("CHAIN_COST_TIMING_LOG"):
            hcm.setdefault("access_log", []).append(timing_log(os.environ["CHAIN_COST_TIMING_LOG"]))
        return config

    bootstrap.build_bootstrap = build  # type: ignore[assignment]
    from poolkeeper.cli.main import main

    return main(argv)


# -- the driver ---------------------------------------------------------------------------------


def start(
    args: argparse.Namespace, stack: contextlib.ExitStack, tmp: Path
) -> tuple[dict[str, str], dict[str, int]]:
    """The simulator, the serve variants, the floors and peers (stopped by `stack`): the
    targets' URLs and each serve's pid."""
    from poolkeeper.bench.live import live_processes as procs, live_targets
    from poolkeeper.bench.overhead import overhead_gateway as go
    from poolkeeper.bench.overhead.overhead_floor import floor_gateways
    from poolkeeper.netutil import free_ports

    (sim_port,) = free_ports(1)
    (tmp / "sim.yaml").write_text(go.SIM_CONFIG)
    sim = ["sim", "--count", "1", "--port", str(sim_port), "--model", go.MODEL, "--time-scale",
           "0.001", "--max-num-seqs", "1024", "--config", str(tmp / "sim.yaml")]  # fmt: skip
    stack.enter_context(procs.process([sys.executable, "-m", "poolkeeper", *sim], tmp / "sim.log"))
    targets = {"direct": f"http://127.0.0.1:{sim_port}/v1/chat/completions"}
    serves: dict[str, int] = {}
    for spec in args.variant:
        name, _, rest = spec.partition("=")
        drop, _, pythonpath = rest.partition("@")
        (config := tmp / f"config-{name}").mkdir()
        ports = free_ports(5)
        go.write_config(config, sim_port, ports)
        if "scrape1s" in drop.split(","):
            _scrape_every_second(config)
        env = {"CHAIN_COST_GC_LOG": str(tmp / f"gc-{name}.txt")}
        if args.timing:
            env["CHAIN_COST_TIMING_LOG"] = str(tmp / f"timing-{name}.log")
            env["CHAIN_COST_EPP_TIMES"] = str(tmp / f"epp-{name}.json")
        if args.profile:
            env["CHAIN_COST_PROFILE"] = str(tmp / f"profile-{name}.txt")
        if pythonpath:
            env["PYTHONPATH"] = pythonpath
        cmd = [sys.executable, __file__, "--serve-variant", drop, "serve", "-f", str(config),
               "--workdir", str(tmp / f"envoy-{name}"), "--log-level", "warning"]  # fmt: skip
        serve = stack.enter_context(procs.process(cmd, tmp / f"serve-{name}.log", env))
        serves[name] = serve.pid
        targets[name] = f"http://127.0.0.1:{ports[0]}/v1/chat/completions"
    if args.floor:
        logger = (lambda slug: timing_log(str(tmp / f"timing-{slug}.log"))) if args.timing else None
        floors = stack.enter_context(floor_gateways(tmp, sim_port, go.cpu_seconds, logger))
        targets |= {name: url for name, (url, _) in floors.items()}
    for name in [p for p in args.peers.split(",") if p]:
        cmd, port, ready = live_targets.router_command(name, procs.repo_root(), tmp, [sim_port], [])
        stack.enter_context(procs.process(cmd, tmp / f"{name}.log"))
        procs.wait_http(ready, lambda s: s == 200, 60, name)
        targets[name] = f"http://127.0.0.1:{port}/v1/chat/completions"
    return targets, serves


async def measure(
    args: argparse.Namespace, targets: dict[str, str], serves: dict[str, int]
) -> tuple[list[dict[str, float]], dict[str, float], dict[str, float]]:
    """Interleaved rounds: each round's added p50 per target, and per serve the EPP's and its
    Envoy's CPU ms per request over all rounds."""
    from poolkeeper.bench.overhead import overhead_gateway as go, overhead_peers as peer

    for url in targets.values():
        await go.wait_http(url)
    body = go.body_of(args.prompt_bytes) if args.prompt_bytes else go.BODY
    await peer.interleaved(targets, 20, 2.0, body)  # warm-up
    epp0 = {n: go.cpu_seconds(p) for n, p in serves.items()}
    tree0 = {n: peer.tree_cpu_seconds(p) for n, p in serves.items()}
    rounds: list[dict[str, float]] = []
    for i in range(args.rounds):
        load = os.getloadavg()[0]
        rows = await peer.interleaved(targets, args.rate, args.seconds, body)
        rounds.append(
            {"load": load} | {n: r["added_p50"] for n, r in rows.items() if n != "direct"}
        )
        shown = "  ".join(f"{n} {v:.2f}" for n, v in rounds[-1].items() if n != "load")
        print(f"round {i} (load {load:.1f}): {shown}", flush=True)
    n = args.rounds * int(args.rate * args.seconds)
    epp = {k: (go.cpu_seconds(p) - epp0[k]) / n * 1000 for k, p in serves.items()}
    envoy = {
        k: (peer.tree_cpu_seconds(p) - tree0[k]) / n * 1000 - epp[k] for k, p in serves.items()
    }
    loops: dict[str, list[tuple[float, float]]] = {k: [] for k in serves}
    for i in range(args.loops):  # closed loops, serve by serve, the order reversed each time
        for name in list(serves) if i % 2 == 0 else list(reversed(serves)):
            pid = serves[name]
            clocks = {"epp": lambda p=pid: go.cpu_seconds(p),
                      "all": lambda p=pid: peer.tree_cpu_seconds(p)}  # fmt: skip
            row = await peer.closed_loop(targets[name], clocks, args.loop_seconds, 16, body)
            done = row["requests"]
            loops[name].append((row["epp_cpu_s"] / done * 1000, row["all_cpu_s"] / done * 1000))
    for name, values in loops.items():
        if values:
            eppm = statistics.median(v[0] for v in values)
            allm = statistics.median(v[1] for v in values)
            print(f"closed loop, 16 clients, {name}: EPP {eppm:.3f} ms, Envoy "
                  f"{allm - eppm:.3f} ms CPU per request (median of {len(values)})")  # fmt: skip
    return rounds, epp, envoy


def report(
    rounds: list[dict[str, float]], epp: dict[str, float], envoy: dict[str, float], tmp: Path
) -> None:
    names = [n for n in rounds[0] if n != "load"]
    print("\n| target | added p50 ms, median of rounds [min-max] | EPP CPU ms/request "
          "| its Envoy's CPU ms/request | EPP GC passes after start-up (n, ms) |")  # fmt: skip
    print("|---|---|---|---|---|")
    for name in names:
        values = [r[name] for r in rounds]
        cpu = f"{epp[name]:.2f} | {envoy[name]:.3f}" if name in epp else "- | -"
        passes = "-"
        with contextlib.suppress(OSError):
            passes = (tmp / f"gc-{name}.txt").read_text().strip()
        spread = f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"
        print(f"| {name} | {spread} | {cpu} | {passes} |")
    first = names[0]
    print(f"\nPer round, minus {first}:")
    for name in names[1:]:
        diff = [r[name] - r[first] for r in rounds]
        below = sum(d < 0 for d in diff)
        print(f"- {name}: median {statistics.median(diff):+.2f} ms "
              f"[{min(diff):+.2f} to {max(diff):+.2f}], below in {below}/{len(diff)}")  # fmt: skip
    print(f"\nLoad average at each round's start: {[round(r['load'], 1) for r in rounds]}")


def report_timing(tmp: Path) -> None:
    """Medians of each gateway's Envoy clock (all requests, warm-up and closed loops included:
    compare gateways, not rounds) and of its EPP's wall and CPU per stream."""
    print("\n| gateway (Envoy's clock, us, median) | " + " | ".join(TIMING_FIELDS) + " | n |")
    print("|---|" + "---|" * (len(TIMING_FIELDS) + 1))
    for path in sorted(tmp.glob("timing-*.log")):
        columns: list[list[int]] = [[] for _ in TIMING_FIELDS]
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) != len(TIMING_FIELDS) + 1 or parts[-1] != "200":
                continue
            for column, value in zip(columns, parts, strict=False):
                if value.isdigit():
                    column.append(int(value))
        cells = [f"{statistics.median(c):.0f}" if c else "-" for c in columns]
        print(f"| {path.stem[7:]} | " + " | ".join(cells) + f" | {len(columns[0])} |")
    for path in sorted(tmp.glob("epp-*.json")):
        with contextlib.suppress(OSError, ValueError):
            pairs = json.loads(path.read_text())
            if pairs:
                m = [statistics.median(p[i] for p in pairs) for i in range(4)]
                print(f"- EPP {path.stem[4:]}, medians of {len(pairs)} streams: last request "
                      f"frame read -> trailers written: wall {m[0]:.0f} us, loop-thread CPU "
                      f"{m[1]:.0f} us; stream opened -> trailers: wall {m[2]:.0f}, CPU "
                      f"{m[3]:.0f} us")  # fmt: skip


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--serve-variant":
        return serve_variant({d for d in sys.argv[2].split(",") if d}, sys.argv[3:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", action="append", required=True,
                        help=f"NAME=DROP[@PYTHONPATH]; DROP from {sorted(PARTS)}")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=15.0, help="per round")
    parser.add_argument("--rate", type=float, default=10.0, help="ticks per second")
    parser.add_argument("--prompt-bytes", type=int, default=0, help="0: the chat 'hi' body")
    parser.add_argument("--floor", action="store_true", help="also the floor gateways")
    parser.add_argument("--peers", default="", help="e.g. sglang-router")
    parser.add_argument("--loops", type=int, default=0, help="closed loops per serve, after")
    parser.add_argument("--loop-seconds", type=float, default=6.0)
    parser.add_argument("--json", default="", help="also write the rounds here")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="cProfile each serve's EPP (profile-NAME.txt in the run's folder)",
    )
    parser.add_argument("--timing", action="store_true",
                        help="Envoy's per-request clock (an access log) and the EPP's wall/CPU "
                             "per stream, medians per gateway")  # fmt: skip
    args = parser.parse_args()
    for spec in args.variant:
        name, _, rest = spec.partition("=")
        unknown = set(rest.partition("@")[0].split(",")) - PARTS - {""}
        if not name or unknown:
            parser.error(f"--variant {spec!r}: NAME=DROP[@PYTHONPATH], DROP from {sorted(PARTS)}")
    tmp = Path(tempfile.mkdtemp(prefix="chain-cost-"))
    with contextlib.ExitStack() as stack:
        targets, serves = start(args, stack, tmp)
        rounds, epp, envoy = asyncio.run(measure(args, targets, serves))
    report(rounds, epp, envoy, tmp)  # after the serves stopped: their GC logs are written
    if args.timing:
        report_timing(tmp)
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": rounds, "epp": epp, "envoy": envoy}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
