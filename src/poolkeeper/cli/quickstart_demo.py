"""The quickstart's demo load and its report: a seeded mix of the demo models' requests
(`demo_plan`) driven through the gateway with a progress bar (`drive_load`), each one's `Outcome`,
the weighted split read from the gateway's metrics (`split_from_metrics`), and the tables of
where requests went and latency, queueing and refusals per model (`report`)."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from poolkeeper.cli.quickstart_resources import DEMO_MODELS

SERVED = "x-gateway-destination-endpoint-served"


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


def demo_plan(n: int, rng: random.Random) -> list[tuple[str, str, bool]]:
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
    plan = demo_plan(n, random.Random(seed))
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
