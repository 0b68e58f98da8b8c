"""`poolkeeper quickstart` (and `make demo`): a whole gateway on this machine in one command.

Starts a small simulated fleet (a base model and four LoRA adapters), writes an example pool and
InferenceModels (a 70/30 weighted split, and all three criticalities) to a temporary directory,
starts the gateway (endpoint picker + Envoy), drives a short mixed load through it with a
progress bar, prints where the requests went, latency per model and criticality and how many
were shed, then keeps serving until Ctrl-C with a curl command to try.

    poolkeeper quickstart                    # demo, then serve until Ctrl-C
    poolkeeper quickstart --no-serve         # demo only (CI)
    poolkeeper quickstart --duration 30      # serve 30 s after the demo, then stop

This module owns the command and the run (fleet, gateway, demo, serving); what it serves is
`quickstart_resources`, the demo load and its report `quickstart_demo`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console

from poolkeeper.cli.quickstart_demo import DemoRecord, drive_load, report, split_from_metrics
from poolkeeper.cli.quickstart_resources import ADAPTERS, BASE_MODEL, write_resources
from poolkeeper.controller.files import file_source
from poolkeeper.envoy.process import EnvoyNotFound
from poolkeeper.errors import ConfigError
from poolkeeper.server.options import ServeOptions
from poolkeeper.server.runtime import GatewayRuntime
from poolkeeper.server.signals import on_stop_signals
from poolkeeper.sim.cluster import SimCluster
from poolkeeper.sim.config import ServerSettings, build_fleet


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "quickstart",
        help="run a simulated fleet behind the gateway and show where requests go",
        description="Start simulated model servers, an example pool and models, and the "
        "gateway; drive a short mixed load; print a report; then serve until Ctrl-C.",
    )
    parser.add_argument("--servers", type=int, default=3, help="simulated servers (3)")
    parser.add_argument("--requests", type=int, default=200, help="demo requests (200)")
    parser.add_argument("--concurrency", type=int, default=48, help="requests in flight (48)")
    parser.add_argument(
        "--time-scale", type=float, default=0.3, help="simulator speed: 0.3 = 3.3x faster"
    )
    parser.add_argument("--no-serve", action="store_true", help="stop after the report")
    parser.add_argument(
        "--duration", type=float, default=None, help="serve this many seconds after the report"
    )
    parser.add_argument("--envoy-path", default=None, help="Envoy binary to run")
    parser.add_argument("--seed", type=int, default=7, help="random seed of the demo load")
    parser.set_defaults(handler=run_quickstart)


async def quickstart(
    args: argparse.Namespace, console: Console, record: DemoRecord | None = None
) -> int:
    """Runs the demo (and then serves unless --no-serve); what the demo measured goes into
    `record` when given, so a caller can check it rather than the printed tables."""
    # Few running slots per server, so the demo's burst queues up and the pool saturates:
    # that is when Sheddable requests are shed and Critical ones still get through.
    settings = ServerSettings(
        lora_adapters=list(ADAPTERS),
        max_loras=2,
        max_num_seqs=4,
        time_scale=args.time_scale,
        seed=args.seed,
    )
    cluster = SimCluster(build_fleet(count=args.servers, cli=settings))
    listening = await cluster.start()
    runtime: GatewayRuntime | None = None
    try:
        with tempfile.TemporaryDirectory(prefix="poolkeeper-quickstart-") as tmp:
            directory = Path(tmp) / "config"  # watched for hot reload: nothing else goes here
            directory.mkdir()
            sim_ports = [where.port for where in listening]
            write_resources(directory, sim_ports)
            console.print(
                f"[bold]{len(listening)} simulated servers[/] ({BASE_MODEL} + "
                f"{len(ADAPTERS)} LoRA adapters) on ports {', '.join(map(str, sim_ports))}"
            )
            runtime = GatewayRuntime(
                ServeOptions(
                    source=file_source([directory]),
                    envoy_path=args.envoy_path,
                    workdir=Path(tmp) / "envoy",
                )
            )
            await runtime.start()
            for _ in range(100):  # wait for the first scrapes so the demo starts "ready"
                if runtime.ready():
                    break
                await asyncio.sleep(0.05)
            url = runtime.http_url
            assert runtime.config is not None  # set by start()
            listeners = runtime.config.spec.listeners
            console.print(f"[bold green]gateway ready[/] on {url} (config in {directory})")
            results = await drive_load(url, args.requests, args.concurrency, args.seed, console)
            sims = {f"127.0.0.1:{w.port}": w.name for w in listening}
            assert runtime.metrics is not None
            split = split_from_metrics(runtime.metrics.render().decode(), "food-review")
            gate = runtime.director.flow if runtime.director is not None else None
            totals = {(str(b), o): n for (b, o), n in gate.totals.items()} if gate else None
            report(results, sims, console, split, totals)
            if record is not None:
                record.outcomes.extend(results)
                record.split.update(split)
                record.flow.update(totals or {})
            if args.no_serve:
                return 0 if any(o.status == 200 for o in results) else 1
            console.print(
                "\nTry it:\n"
                f"  curl -s {url}/v1/chat/completions -H 'content-type: application/json' "
                '-d \'{"model": "food-review", "messages": [{"role": "user", '
                '"content": "hi"}], "max_tokens": 16}\'\n'
                f"  curl -s {url}/v1/models\n"
                f"  metrics: http://127.0.0.1:{listeners.metrics}/metrics\n"
                "Serving until Ctrl-C.",
                soft_wrap=True,  # keep the curl command on one line for copy and paste
            )
            await _wait_for_stop(args.duration)
            return 0
    finally:
        if runtime is not None:
            await runtime.stop(grace_s=1.0)
        await cluster.stop()


async def _wait_for_stop(duration: float | None) -> None:
    stop = asyncio.Event()
    remove_handlers = on_stop_signals(asyncio.get_running_loop(), stop.set)
    try:
        if duration is None:
            await stop.wait()
        else:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), duration)
    finally:
        remove_handlers()


def run_quickstart(args: argparse.Namespace) -> int:
    console = Console()
    if args.requests < 1 or args.servers < 1 or args.concurrency < 1:
        print("error: --requests, --servers and --concurrency must be at least 1", file=sys.stderr)
        return 2
    try:
        return asyncio.run(quickstart(args, console))
    except (EnvoyNotFound, ConfigError) as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
