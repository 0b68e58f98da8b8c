"""`poolkeeper quickstart` (and `make demo`): a whole gateway on this machine in one command.

Starts a small simulated fleet (a base model and four LoRA adapters), writes an example pool and
InferenceModels (a 70/30 weighted split, and all three criticalities) to a temporary directory,
starts the gateway (endpoint picker + Envoy), drives a short mixed load through it with a
progress bar, prints where the requests went, latency per model and criticality and how many
were shed, then keeps serving until Ctrl-C with a curl command to try.

    poolkeeper quickstart                    # demo, then serve until Ctrl-C
    poolkeeper quickstart --no-serve         # demo only (CI)
    poolkeeper quickstart --duration 30      # serve 30 s after the demo, then stop
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from poolkeeper.controller.files import file_source
from poolkeeper.envoy.process import EnvoyNotFound
from poolkeeper.errors import ConfigError
from poolkeeper.netutil import free_ports
from poolkeeper.server.options import ServeOptions
from poolkeeper.server.runtime import GatewayRuntime
from poolkeeper.server.signals import on_stop_signals
from poolkeeper.sim.config import ServerSettings, build_fleet
from poolkeeper.sim.server import SimCluster

BASE_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
ADAPTERS = ("food-review-v1", "food-review-v2", "tweet-summary-1", "tweet-summary-2")
SERVED = "x-gateway-destination-endpoint-served"
# (client-facing model, criticality, share of the demo load)
DEMO_MODELS = (
    (BASE_MODEL, "Critical", 0.25),
    ("food-review", "Standard", 0.45),
    ("tweet-summary", "Sheddable", 0.30),
)

RESOURCES = """\
apiVersion: poolkeeper.dev/v1alpha1
kind: GatewayConfig
metadata: {{name: quickstart}}
spec:
  listeners: {{http: {http}, extProc: {ext_proc}, metrics: {metrics}, health: {health},
    admin: {admin}}}
  scraping: {{intervalMs: 50, timeoutMs: 1000}}
  endpoints:
{endpoints}---
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferencePool
metadata: {{name: quickstart-pool, namespace: default}}
spec:
  selector: {{app: quickstart-sim}}
  targetPortNumber: 8000
  extensionRef: {{name: quickstart-epp, failureMode: FailClose}}
---
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceModel
metadata: {{name: base, namespace: default}}
spec:
  modelName: {base}
  criticality: Critical
  poolRef: {{name: quickstart-pool}}
---
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceModel
metadata: {{name: food-review, namespace: default}}
spec:
  modelName: food-review
  criticality: Standard
  targetModels:
    - {{name: food-review-v1, weight: 70}}
    - {{name: food-review-v2, weight: 30}}
  poolRef: {{name: quickstart-pool}}
---
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceModel
metadata: {{name: tweet-summary, namespace: default}}
spec:
  modelName: tweet-summary
  criticality: Sheddable
  targetModels:
    - {{name: tweet-summary-1}}
    - {{name: tweet-summary-2}}
  poolRef: {{name: quickstart-pool}}
"""


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


@dataclass(frozen=True, slots=True)
class Outcome:
    model: str
    criticality: str
    status: int
    seconds: float
    served: str  # ip:port or ""


@dataclass
class DemoRecord:
    """What one demo run measured: every request's outcome, the weighted split of
    food-review by target model (from the gateway's metrics), and flow control's totals by
    (criticality, outcome or "queued")."""

    outcomes: list[Outcome] = field(default_factory=list)
    split: Counter[str] = field(default_factory=Counter)
    flow: Counter[tuple[str, str]] = field(default_factory=Counter)


def write_resources(directory: Path, sim_ports: list[int]) -> dict[str, int]:
    http, ext_proc, metrics, health, admin = free_ports(5)
    endpoints = "".join(
        f"    - {{name: sim-{i}, address: 127.0.0.1, port: {port}, "
        "labels: {app: quickstart-sim}}\n"
        for i, port in enumerate(sim_ports)
    )
    ports = {"http": http, "ext_proc": ext_proc, "metrics": metrics, "health": health,
             "admin": admin}  # fmt: skip
    text = RESOURCES.format(endpoints=endpoints, base=BASE_MODEL, **ports)
    (directory / "quickstart.yaml").write_text(text)
    return ports


def _plan(n: int, rng: random.Random) -> list[tuple[str, str, bool]]:
    """(model, criticality, stream) for each demo request, in a seeded shuffled order."""
    plan = []
    for model, criticality, share in DEMO_MODELS:
        plan += [(model, criticality, rng.random() < 0.5) for _ in range(round(n * share))]
    rng.shuffle(plan)
    return plan[:n]


async def _one(
    session: aiohttp.ClientSession, url: str, model: str, criticality: str, stream: bool
) -> Outcome:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"Write one line about {model}."}],
        "max_tokens": 24,
        "stream": stream,
    }
    began = time.perf_counter()
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
            await resp.read()
            served = resp.headers.get(SERVED, "")
            status = resp.status
    except (aiohttp.ClientError, TimeoutError):
        status, served = 0, ""
    return Outcome(model, criticality, status, time.perf_counter() - began, served)


def split_from_metrics(text: str, model: str) -> Counter[str]:
    """Requests per target model for one client model, from the gateway's own metrics
    (responses carry the client's model name, so they cannot tell)."""
    out: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if (
                sample.name == "inference_model_request_total"
                and sample.labels.get("model_name") == model
            ):
                out[sample.labels.get("target_model_name", "")] += int(sample.value)
    return out


async def drive_load(
    url: str, n: int, concurrency: int, seed: int, console: Console
) -> list[Outcome]:
    plan = _plan(n, random.Random(seed))
    semaphore = asyncio.Semaphore(concurrency)
    outcomes: list[Outcome] = []
    timeout = aiohttp.ClientTimeout(total=60)
    with Progress(
        TextColumn("[bold]driving mixed load"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as progress:
        task = progress.add_task("load", total=len(plan))
        async with aiohttp.ClientSession(timeout=timeout) as session:

            async def run(item: tuple[str, str, bool]) -> None:
                async with semaphore:
                    outcomes.append(await _one(session, url, *item))
                    progress.advance(task)

            await asyncio.gather(*(run(item) for item in plan))
    return outcomes


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report(
    outcomes: list[Outcome],
    sims: dict[str, str],
    console: Console,
    split: Counter[str],
    flow: Mapping[tuple[str, str], int] | None = None,
) -> None:
    """Where requests went, latency, queueing and refusals per model, and the weighted split.

    `flow`: flow control's totals by (criticality, outcome) (`FlowGate.totals`), for the
    queued and expired columns."""
    flow = flow or {}
    where = Table(title="Where requests went (model by server)")
    servers = sorted({sims.get(o.served, o.served or "?") for o in outcomes if o.status == 200})
    where.add_column("model")
    for server in servers:
        where.add_column(server, justify="right")
    where.add_column("total", justify="right")
    by_model: dict[str, Counter[str]] = defaultdict(Counter)
    for o in outcomes:
        if o.status == 200:
            by_model[o.model.rpartition("/")[2]][sims.get(o.served, o.served or "?")] += 1
    for model in sorted(by_model):
        counts = by_model[model]
        where.add_row(model, *(str(counts[s]) for s in servers), str(sum(counts.values())))
    console.print(where)

    latency = Table(title="Latency per model and criticality (successful requests)")
    cols = ("model", "criticality", "ok", "p50 ms", "p99 ms", "queued", "shed 429", "expired 429",
            "errors")  # fmt: skip
    for col in cols:
        latency.add_column(col, justify="left" if col in ("model", "criticality") else "right")
    for model, criticality, _ in DEMO_MODELS:
        mine = [o for o in outcomes if o.model == model]
        ok = [o.seconds * 1000 for o in mine if o.status == 200]
        expired = flow.get((criticality, "EvictedTTL"), 0)
        shed = sum(1 for o in mine if o.status == 429) - expired  # a TTL expiry is a 429 too
        other = sum(1 for o in mine if o.status not in (200, 429))
        latency.add_row(
            model.rpartition("/")[2],
            criticality,
            str(len(ok)),
            f"{_percentile(ok, 0.5):.0f}",
            f"{_percentile(ok, 0.99):.0f}",
            str(flow.get((criticality, "queued"), 0)),
            str(shed),
            str(expired),
            str(max(0, other)),
        )
    console.print(latency)
    total = sum(split.values())
    if total:
        shares = ", ".join(f"{t} {100 * c / total:.0f} %" for t, c in sorted(split.items()))
        console.print(f"food-review weighted split (70/30 configured): {shares}")


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
