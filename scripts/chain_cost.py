"""What each part of `serve`'s per-request Envoy chain costs: `serve` variants side by side.

Starts one simulator (`gateway_overhead.SIM_CONFIG`) and one `poolkeeper serve` per
`--variant NAME=DROP[@PYTHONPATH]`, each with its own EPP and Envoy, where DROP names the parts
taken out of that serve's bootstrap (comma-separated: `lua` the response observer's Lua filter,
`resp` the response processor, `als` the gRPC access log, `early` the early header mutation;
empty: the bootstrap as shipped) and PYTHONPATH, when given, runs that serve from another tree
(e.g. a `git archive` of main's `src/`: an A/B of two commits). Optionally the `--floor`
gateways and `--peers` join. Then rounds of interleaved light load (every target once per tick,
the order rotated, `overhead_peers.interleaved`) and, per serve, the EPP's and its Envoy's CPU
per request over all rounds, and the EPP's garbage-collector passes after start-up (count and
total ms per generation).

Taking a part out breaks what it provides (no access log: requests never complete in the EPP's
accounting), so a variant is a measurement, never a configuration. Not a test: run it by hand,
and record `uptime`: on a shared host only differences inside one run mean much.

    .venv/bin/python scripts/chain_cost.py --variant shipped= --variant no-lua=lua \\
        --variant none=lua,resp,als --floor --peers sglang-router --rounds 8 --seconds 15
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


def serve_variant(drop: set[str], argv: list[str]) -> int:
    """`poolkeeper serve ARGV` with the parts in `drop` taken out of its bootstrap."""
    if os.environ.get("CHAIN_COST_GC_LOG"):
        _gc_log(os.environ["CHAIN_COST_GC_LOG"])
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
        return config

    bootstrap.build_bootstrap = build
    from poolkeeper.cli.main import main

    return main(argv)


# -- the driver ---------------------------------------------------------------------------------


def start(
    args: argparse.Namespace, stack: contextlib.ExitStack, tmp: Path
) -> tuple[dict[str, str], dict[str, int]]:
    """The simulator, the serve variants, the floors and peers (stopped by `stack`): the
    targets' URLs and each serve's pid."""
    from poolkeeper.bench.live import live
    from poolkeeper.bench.overhead import gateway_overhead as go
    from poolkeeper.bench.overhead.overhead_floor import floor_gateways
    from poolkeeper.netutil import free_ports

    (sim_port,) = free_ports(1)
    (tmp / "sim.yaml").write_text(go.SIM_CONFIG)
    sim = ["sim", "--count", "1", "--port", str(sim_port), "--model", go.MODEL, "--time-scale",
           "0.001", "--max-num-seqs", "1024", "--config", str(tmp / "sim.yaml")]  # fmt: skip
    stack.enter_context(live.process([sys.executable, "-m", "poolkeeper", *sim], tmp / "sim.log"))
    targets = {"direct": f"http://127.0.0.1:{sim_port}/v1/chat/completions"}
    serves: dict[str, int] = {}
    for spec in args.variant:
        name, _, rest = spec.partition("=")
        drop, _, pythonpath = rest.partition("@")
        (config := tmp / f"config-{name}").mkdir()
        ports = free_ports(5)
        go.write_config(config, sim_port, ports)
        env = {"CHAIN_COST_GC_LOG": str(tmp / f"gc-{name}.txt")}
        if pythonpath:
            env["PYTHONPATH"] = pythonpath
        cmd = [sys.executable, __file__, "--serve-variant", drop, "serve", "-f", str(config),
               "--workdir", str(tmp / f"envoy-{name}"), "--log-level", "warning"]  # fmt: skip
        serve = stack.enter_context(live.process(cmd, tmp / f"serve-{name}.log", env))
        serves[name] = serve.pid
        targets[name] = f"http://127.0.0.1:{ports[0]}/v1/chat/completions"
    if args.floor:
        floors = stack.enter_context(floor_gateways(tmp, sim_port, go.cpu_seconds))
        targets |= {name: url for name, (url, _) in floors.items()}
    for name in [p for p in args.peers.split(",") if p]:
        cmd, port, ready = live.router_command(name, live.repo_root(), tmp, [sim_port], [])
        stack.enter_context(live.process(cmd, tmp / f"{name}.log"))
        live.wait_http(ready, lambda s: s == 200, 60, name)
        targets[name] = f"http://127.0.0.1:{port}/v1/chat/completions"
    return targets, serves


async def measure(
    args: argparse.Namespace, targets: dict[str, str], serves: dict[str, int]
) -> tuple[list[dict[str, float]], dict[str, float], dict[str, float]]:
    """Interleaved rounds: each round's added p50 per target, and per serve the EPP's and its
    Envoy's CPU ms per request over all rounds."""
    from poolkeeper.bench.overhead import gateway_overhead as go, overhead_peers as peer

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


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--serve-variant":
        return serve_variant({d for d in sys.argv[2].split(",") if d}, sys.argv[3:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", action="append", required=True,
                        help="NAME=DROP[@PYTHONPATH]; DROP from lua,resp,als,early")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=15.0, help="per round")
    parser.add_argument("--rate", type=float, default=10.0, help="ticks per second")
    parser.add_argument("--prompt-bytes", type=int, default=0, help="0: the chat 'hi' body")
    parser.add_argument("--floor", action="store_true", help="also the floor gateways")
    parser.add_argument("--peers", default="", help="e.g. sglang-router")
    parser.add_argument("--loops", type=int, default=0, help="closed loops per serve, after")
    parser.add_argument("--loop-seconds", type=float, default=6.0)
    parser.add_argument("--json", default="", help="also write the rounds here")
    args = parser.parse_args()
    for spec in args.variant:
        name, _, rest = spec.partition("=")
        unknown = set(rest.partition("@")[0].split(",")) - {"", "lua", "resp", "als", "early"}
        if not name or unknown:
            parser.error(
                f"--variant {spec!r}: NAME=DROP[@PYTHONPATH], DROP from lua,resp,als,early"
            )
    tmp = Path(tempfile.mkdtemp(prefix="chain-cost-"))
    with contextlib.ExitStack() as stack:
        targets, serves = start(args, stack, tmp)
        rounds, epp, envoy = asyncio.run(measure(args, targets, serves))
    report(rounds, epp, envoy, tmp)  # after the serves stopped: their GC logs are written
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": rounds, "epp": epp, "envoy": envoy}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
