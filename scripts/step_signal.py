"""How late, and how spread, the EPP learns the simulated engines' step ends (bench only).

Starts N simulated servers at time scale 1 (this script's `sims` command: `SimCluster` with
each engine's `step_observer` recording every step end, `bench/live/step_signal.py`
`step_end`), `poolkeeper serve` (Envoy + EPP, the default profile) with
`POOLKEEPER_BENCH_SIGNAL_LOG` set (`extproc/signal_tap.py`: the EPP writes when each
first-byte report and access-log entry arrives, and Envoy's stamps), then sends the workload
open loop at `--load` x the fleet's capacity for `--duration` s as streaming chat requests,
each with its own tag header (`signal_tap.TAG_HEADER`), and reads the simulator's request id
back from the stream. Everything on 127.0.0.1, bounded in count (`--max-requests`) and time.
Per run it prints and writes OUT/runN.json: the delay from the step end to the EPP's receipt
of the first-byte report and of the access-log entry (also from the driver's delivery of the
step), the error of Envoy's stamps against the step end, the share of steps the EPP learns,
and `uptime` before and after. `--kv-events`: the servers also publish their KV-cache events
(`sim/kvpublish.py`: one batch per step that stored or evicted a block, stamped at its end)
and the EPP's prefix scorer subscribes (exact mode); the tap logs each batch's arrival, the
sims each batch they send, and a probe process (`probe`: an idle blocking SUB of its own)
each batch's arrival there: the batches' lateness at the EPP, the publisher's part and the
EPP loop's part (`kv` in the summary; docs/notes/2026-12-07-kv-events-decode.md).
Times: CLOCK_MONOTONIC (system-wide on Linux); Envoy's
wall-clock stamps are moved to it with the EPP's own wall - monotonic offset. Example
(docs/notes/2026-12-07-step-signal-timing.md):

    .venv/bin/python scripts/step_signal.py --out bench-results/stepsignal --servers 2 \\
        --load 0.6 --duration 20 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import aiohttp

from poolkeeper.bench.fleet.simrun import fleet_capacity
from poolkeeper.bench.live.live_processes import READY_TIMEOUT_S, process, wait_http
from poolkeeper.bench.live.live_targets import envoy_binary, models_of, poolkeeper_config
from poolkeeper.bench.live.loadgen import check_loopback, stream_body
from poolkeeper.bench.live.step_signal import (
    StepEnd,
    delays_ms,
    earliest_per_step,
    join,
    kv_lateness,
    learned_fraction,
    minus,
    sim_id,
    step_end,
)
from poolkeeper.bench.workload.scenarios import adapter_names, build_scenario
from poolkeeper.bench.workload.workload_spec import Arrival, default_spec
from poolkeeper.bench.workload.workloads import generate
from poolkeeper.extproc.signal_tap import SIGNAL_LOG_ENV, TAG_HEADER
from poolkeeper.netutil import free_ports
from poolkeeper.scheduling.presets import preset_document
from poolkeeper.server.signals import on_stop_signals
from poolkeeper.sim.cluster import SimCluster
from poolkeeper.sim.config import ServerSettings, build_fleet

NAMES = ("http", "extproc", "metrics", "health", "admin")
SIM_MAX_S = 600.0  # the sims process stops itself after this, whatever happens


# -- the simulated servers, in their own process ---------------------------------------------


async def serve_sims(
    count: int, port: int, seed: int, out: Path, kv_offset: int | None, kv_log: Path | None
) -> None:
    specs = build_fleet(
        count=count,
        cli=ServerSettings.model_validate({"model": "base-model", "seed": seed, "time_scale": 1}),
    )
    cluster = SimCluster(specs, base_port=port, kv_events_port_offset=kv_offset)
    steps: list[StepEnd] = []
    for server in cluster.servers:
        name = server.name

        def observe(step: Any, name: str = name) -> None:
            steps.append(step_end(name, step, time.monotonic()))

        server.engine.step_observer = observe
    stop = asyncio.Event()
    on_stop_signals(asyncio.get_running_loop(), stop.set)
    await cluster.start()
    published: list[dict[str, float]] = []
    for server in cluster.servers if kv_offset is not None else ():
        record_batches(server.engine, server.port, published)
    try:
        await asyncio.wait_for(stop.wait(), SIM_MAX_S)
    except TimeoutError:
        pass
    finally:
        await cluster.stop()
        with out.open("w") as fh:
            for step in steps:
                fh.write(json.dumps(step.as_record()) + "\n")
        if kv_log is not None:
            with kv_log.open("w") as fh:
                fh.writelines(json.dumps(r) + "\n" for r in published)


def record_batches(engine: Any, port: int, out: list[dict[str, float]]) -> None:
    """Wrap the engine's KV step end: each batch its publisher sends, with the step's modelled
    end and the send's time (monotonic) and the batch's stamp (wall)."""
    publisher = engine.kv.sink
    inner = engine.kv_step_end

    def kv_end(end: float) -> None:
        before = publisher.sent
        inner(end)
        if publisher.sent != before:
            out.append({"port": port, "end": end, "pub": time.monotonic(),
                        "ts": publisher.last_ts})  # fmt: skip

    engine.kv_step_end = kv_end


def probe(ports: list[int], offset: int, out: Path) -> None:
    """An idle process's receipt of every KV batch (blocking SUB sockets, one poller): the
    transport's floor, against which the EPP's loop is measured. Until SIGTERM."""
    import signal

    import zmq

    from poolkeeper.kvevents import decode

    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    ctx = zmq.Context()
    poller = zmq.Poller()
    socks: dict[Any, int] = {}
    for port in ports:
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(f"tcp://127.0.0.1:{port + offset}")
        poller.register(sock, zmq.POLLIN)
        socks[sock] = port
    records: list[str] = []
    deadline = time.monotonic() + SIM_MAX_S
    while not stopping and time.monotonic() < deadline:
        for sock, _ in poller.poll(100):
            frames = sock.recv_multipart()
            wall = time.time()
            ts = decode(frames[2]).ts
            records.append(json.dumps({"port": socks[sock], "ts": ts, "wall": wall}))
    out.write_text("".join(r + "\n" for r in records))
    for sock in socks:
        sock.close(linger=0)
    ctx.term()


# -- the client --------------------------------------------------------------------------------


async def one(session: aiohttp.ClientSession, url: str, arrival: Arrival, rid: str) -> Any:
    body = stream_body(arrival)
    sid: str | None = None
    status = 0
    try:
        async with session.post(url, json=body, headers={TAG_HEADER: rid}) as resp:
            status = resp.status
            async for raw in resp.content:
                line = raw.strip()
                if sid is None and line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                    sid = sim_id(str(json.loads(line[5:]).get("id", "")))
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        return rid, sid, type(exc).__name__
    return rid, sid, status


async def send(base: str, arrivals: list[Arrival], tag: str, limit_s: float) -> list[Any]:
    check_loopback(base)
    url = base + "/v1/chat/completions"
    timeout = aiohttp.ClientTimeout(total=limit_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        t0 = time.monotonic()
        tasks = []
        for i, arrival in enumerate(arrivals):
            delay = arrival.time - (time.monotonic() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(session, url, arrival, f"sig-{tag}-{i}")))
        done, pending = await asyncio.wait(tasks, timeout=limit_s)
        for task in pending:
            task.cancel()
    return [t.result() for t in done]


# -- one run -----------------------------------------------------------------------------------


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


# The Lua filter's first-byte stamp in microseconds (a float of ms), not whole ms.
LUA_MS = "handle:timestamp()"
LUA_US = "(tonumber(handle:timestampString(EnvoyTimestampResolution.MICROSECOND)) / 1000)"


def microsecond_bootstrap(cfg: Path) -> str:
    """`poolkeeper envoy-config`'s bootstrap for `cfg` with the Lua filter stamping first bytes
    to the microsecond (`--envoy-us`: what an exact Envoy stamp would give)."""
    text = subprocess.run(
        [sys.executable, "-m", "poolkeeper", "envoy-config", "-f", str(cfg)],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    if LUA_MS not in text:
        raise SystemExit("the observer's Lua filter has no handle:timestamp() to replace")
    return text.replace(LUA_MS, LUA_US)


def run_once(args: argparse.Namespace, arrivals: list[Arrival], tag: str, work: Path) -> Any:
    work.mkdir(parents=True, exist_ok=True)
    steps_file, epp_file = work / "steps.jsonl", work / "epp.jsonl"
    epp_file.unlink(missing_ok=True)
    models = models_of(default_spec(args.workload, args.servers).kind,
                       adapter_names(default_spec(args.workload, args.servers)))  # fmt: skip
    sim_ports = free_ports(args.servers, consecutive=True)
    ports = dict(zip(NAMES, free_ports(len(NAMES)), strict=True))
    sims = [sys.executable, __file__, "sims", "--count", str(args.servers), "--port",
            str(sim_ports[0]), "--seed", str(args.seed), "--steps", str(steps_file)]  # fmt: skip
    scheduling: dict[str, Any] | None = None
    kv_offset = 0
    for name in ("kv_published.jsonl", "kv_probe.jsonl"):
        (work / name).unlink(missing_ok=True)
    if args.kv_events:
        kv_offset = free_ports(args.servers, consecutive=True)[0] - sim_ports[0]
        sims += ["--kv-offset", str(kv_offset), "--kv-log", str(work / "kv_published.jsonl")]
        scheduling = preset_document("default")
        for plugin in scheduling["plugins"]:
            if plugin["type"] == "prefix-cache-scorer":
                plugin["parameters"].update(
                    {"kvEvents": True, "kvEventsPortOffset": kv_offset,
                     "kvEventsReceiveThread": args.receive_thread}
                )  # fmt: skip
    with ExitStack() as stack:
        stack.enter_context(process(sims, work / "sim.log"))
        for p in sim_ports:
            wait_http(f"http://127.0.0.1:{p}/health", lambda s: s == 200, READY_TIMEOUT_S, "sim")
        if args.kv_events:
            probe_out = str(work / "kv_probe.jsonl")
            cmd = [sys.executable, __file__, "probe", "--ports", *map(str, sim_ports),
                   "--offset", str(kv_offset), "--probe-out", probe_out]  # fmt: skip
            stack.enter_context(process(cmd, work / "probe.log"))
        cfg = poolkeeper_config(work / "epp", sim_ports, ports, models, scheduling)
        serve = [sys.executable, "-m", "poolkeeper", "serve", "-f", str(cfg),
                 "--workdir", str(work / "serve"), "--log-level", "warning"]  # fmt: skip
        if args.envoy_us:
            with (cfg / "gateway.yaml").open("a") as gateway:
                gateway.write("  edge: {observeResponses: true}\n")
            serve.append("--no-envoy")
        stack.enter_context(process(serve, work / "serve.log", {SIGNAL_LOG_ENV: str(epp_file)}))
        if args.envoy_us:
            ready = f"http://127.0.0.1:{ports['metrics']}/readyz"
            wait_http(ready, lambda s: s == 200, READY_TIMEOUT_S, "epp")
            envoy = envoy_binary()
            assert envoy is not None
            boot = work / "envoy.json"
            boot.write_text(microsecond_bootstrap(cfg))
            cmd = [envoy, "-c", str(boot), "--concurrency", "1", "--log-level", "warn",
                   "--disable-hot-restart"]  # fmt: skip
            stack.enter_context(process(cmd, work / "envoy.log"))
        base = f"http://127.0.0.1:{ports['http']}"
        wait_http(base + "/v1/models", lambda s: s < 500, READY_TIMEOUT_S, "serve")
        time.sleep(1.0)
        before = uptime()
        results = asyncio.run(send(base, arrivals, tag, args.duration + 40.0))
        after = uptime()
        time.sleep(0.5)  # the last access-log batch (flushed every 20 ms)
    client = {rid: sid for rid, sid, status in results if status == 200 and sid is not None}
    (work / "client.json").write_text(json.dumps(client))  # to join the records again later
    return {
        "uptime_before": before,
        "uptime_after": after,
        "sent": len(arrivals),
        "statuses": sorted({str(s) for _, _, s in results}),
        **summarize(work),
    }


def summarize(work: Path) -> dict[str, Any]:
    """One run's numbers from the records it left in `work` (also `--analyze`)."""
    steps = [StepEnd(r["server"], r["end"], r["delivered"], tuple(r["firsts"]), tuple(r["lasts"]))
             for r in map(json.loads, (work / "steps.jsonl").read_text().splitlines())]  # fmt: skip
    epp = [json.loads(line) for line in (work / "epp.jsonl").read_text().splitlines()]
    client: dict[str, str] = json.loads((work / "client.json").read_text())
    matched = join(steps, client, epp)
    per_step = earliest_per_step(matched)
    kv: dict[str, Any] = {}
    if (work / "kv_published.jsonl").exists():
        published = [json.loads(line) for line in (work / "kv_published.jsonl").open()]
        probed = work / "kv_probe.jsonl"
        idle = [json.loads(line) for line in probed.open()] if probed.exists() else []
        received = [r for r in epp if r.get("kind") == "kv"]
        kv = {"kv": kv_lateness(published, received, idle, steps=len(steps))}
    return {
        **kv,
        "ok": len(client),
        "steps": len(steps),
        "matched": len(matched),
        "epp_rids_match": sum(1 for r in epp if r.get("rid") in client),
        "delivery_lag_ms": delays_ms(s.delivered - s.end for s in steps),
        "first_delay_ms": delays_ms(m.first_delay for m in matched),
        "end_delay_ms": delays_ms(m.end_delay for m in matched),
        # Envoy's stamps against the step end (what the EPP could back-date to).
        "lua_first_stamp_ms": delays_ms(m.lua_first_stamp for m in matched),
        "upstream_first_stamp_ms": delays_ms(m.upstream_first_stamp for m in matched),
        "upstream_last_stamp_ms": delays_ms(m.upstream_last_stamp for m in matched),
        # The same from the driver's delivery of the step (the gateway's part alone).
        "first_after_delivery_ms": delays_ms(minus(m.first_delay, m.first_lag) for m in matched),
        "end_after_delivery_ms": delays_ms(minus(m.end_delay, m.last_lag) for m in matched),
        # Where the first byte's delay goes: the driver's delivery -> Envoy's Lua stamp
        # (the simulator's write and Envoy's read; a whole-ms stamp is ~0.5 ms early on
        # average) -> the EPP's receipt of the report (Envoy's call and the EPP's loop).
        "first_lua_after_delivery_ms": delays_ms(
            minus(m.lua_first_stamp, m.first_lag) for m in matched
        ),
        "first_report_after_lua_ms": delays_ms(
            minus(m.first_delay, m.lua_first_stamp) for m in matched
        ),
        # The end's: delivery -> Envoy's last upstream byte -> the EPP's receipt of the entry.
        "end_upstream_after_delivery_ms": delays_ms(
            minus(m.upstream_last_stamp, m.last_lag) for m in matched
        ),
        "end_entry_after_upstream_ms": delays_ms(
            minus(m.end_delay, m.upstream_last_stamp) for m in matched
        ),
        # Per learnt step, the earliest report and the earliest Envoy stamp.
        "step_report_ms": delays_ms(per_step["report"]),
        "step_stamp_ms": delays_ms(per_step["stamp"]),
        "learned_fraction": learned_fraction(steps, matched),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    sims = sub.add_parser("sims", help="(internal) the simulated servers, recording step ends")
    sims.add_argument("--count", type=int, required=True)
    sims.add_argument("--port", type=int, required=True)
    sims.add_argument("--seed", type=int, default=1)
    sims.add_argument("--steps", type=Path, required=True)
    sims.add_argument("--kv-offset", type=int, default=None)
    sims.add_argument("--kv-log", type=Path, default=None)
    probe_cmd = sub.add_parser("probe", help="(internal) an idle receiver of the KV batches")
    probe_cmd.add_argument("--ports", type=int, nargs="+", required=True)
    probe_cmd.add_argument("--offset", type=int, required=True)
    probe_cmd.add_argument("--probe-out", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path("bench-results/stepsignal"))
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--workload", default="heavy-tail")
    parser.add_argument("--load", type=float, default=0.6, help="x the fleet's capacity")
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-requests", type=int, default=4000)
    parser.add_argument(
        "--envoy-us",
        action="store_true",
        help="run Envoy here (serve --no-envoy) with the Lua first-byte stamp in microseconds",
    )
    parser.add_argument(
        "--kv-events",
        action="store_true",
        help="the servers publish KV events, the EPP subscribes (exact mode); batch lateness",
    )
    parser.add_argument(
        "--receive-thread",
        action="store_true",
        help="with --kv-events: the EPP reads the KV sockets on a thread (kvEventsReceiveThread)",
    )
    parser.add_argument("--analyze", type=Path, nargs="+", help="only summarize these run dirs")
    args = parser.parse_args()
    if args.analyze:
        for work in args.analyze:
            print(json.dumps({"run": str(work), **summarize(work)}, indent=1))
        return 0
    if args.command == "sims":
        asyncio.run(
            serve_sims(args.count, args.port, args.seed, args.steps, args.kv_offset, args.kv_log)
        )
        return 0
    if args.command == "probe":
        probe(args.ports, args.offset, args.probe_out)
        return 0
    if not (1 <= args.servers <= 8 and 0 < args.load <= 1.5 and 0 < args.duration <= 120):
        raise SystemExit("--servers 1..8, --load in (0, 1.5], --duration in (0, 120]")
    scenario = build_scenario(args.workload, args.servers)
    capacity = float(fleet_capacity(scenario, seed=args.seed)["capacity_rps"])
    rate = args.load * capacity
    arrivals = generate(scenario.spec, rate=rate, duration=args.duration, seed=args.seed)
    arrivals = arrivals[: args.max_requests]
    print(f"capacity {capacity:.1f} req/s, rate {rate:.1f} req/s, {len(arrivals)} requests")
    args.out.mkdir(parents=True, exist_ok=True)
    for r in range(args.rounds):
        result = {"servers": args.servers, "workload": args.workload, "load": args.load,
                  "envoy_us": args.envoy_us, "kv_events": args.kv_events,
                  "receive_thread": args.receive_thread,
                  "rate": rate, "duration": args.duration,
                  **run_once(args, arrivals, str(r), args.out / f"run{r}")}  # fmt: skip
        (args.out / f"run{r}.json").write_text(json.dumps(result, indent=1))
        print(json.dumps(result, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
