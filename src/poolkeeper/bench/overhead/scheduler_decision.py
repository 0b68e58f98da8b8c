"""Benchmark: the CPU time of one scheduling decision at 10, 100 and 1,000 endpoints.

Prefix scoring is on, the prompts are realistic (2-8k characters: one of 64 shared system
prompts plus a per-request tail) and the prefix index is warmed first, so matches walk real
chains and PostCycle inserts for real. Endpoint metrics vary, a share of the endpoints have
unseen in-flight requests, and GC stays on (as in production). Two timings per size:

- `schedule`: `Scheduler.schedule` alone (filters, scorers, picker, prefix insertion);
- `schedule CPU`: the same, in thread CPU time (`time.thread_time_ns`), which leaves out the
  time the OS gave the core to other processes: on a shared 2-core machine the wall-clock p99
  is mostly preemption, the CPU p99 is what the code costs;
- `decision path`: `InflightTracker.apply` over the pool + `AdmissionController.decide` +
  `schedule` + `InflightTracker.start`, i.e. what the EPP spends per request on admission and
  endpoint picking.

Every endpoint is scraped again every `SCRAPE_EVERY` decisions (its loads unchanged, a new
`updated_at`), staggered as the EPP's per-endpoint scrape loops are (a 50th of the pool per
decision), so the stale and saturation filters see fresh metrics. (Until 2026-12-07 the
metrics were never re-stamped and went stale 200 decisions in: both filters then failed open
on their cheap paths, leaving ~250 us of the default's decision at 1,000 endpoints out.)

A scheduler that learns from first tokens (`predicted-ttft`, `prefill-backlog`) is told of one
after each decision, outside the timed part: that of the decision n/2 earlier, so a learning
scorer is active for every measured decision and about half the endpoints have a prefill
backlog, as in a busy pool.

Not a test: run it by hand and copy the table into docs/benchmarks.md.

    .venv/bin/python -m poolkeeper.bench.overhead.scheduler_decision [--preset NAME]... [--repeat 3]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import platform
import random
import statistics
import time

from poolkeeper.datastore.endpoint import Endpoint, EndpointMetrics, EndpointState
from poolkeeper.datastore.inflight import InflightTracker
from poolkeeper.flowcontrol.shedding import AdmissionController
from poolkeeper.scheduling.build import build_scheduler
from poolkeeper.scheduling.config import preset_config
from poolkeeper.scheduling.presets import PRESETS
from poolkeeper.scheduling.types import LLMRequest

_SENTENCE = (
    "the model server pool routes requests to endpoints with cached prefixes and low queues "
    "while adapters load and tokens stream back through envoy to every waiting client"
)
WORDS = tuple(_SENTENCE.split(" "))


def text(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    n = 0
    while n < chars:
        w = rng.choice(WORDS)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)[:chars]


def make_pool(rng: random.Random, n: int, now: float) -> list[EndpointState]:
    pool = []
    for i in range(n):
        metrics = EndpointMetrics(
            waiting=rng.randint(0, 8),
            running=rng.randint(0, 32),
            kv_cache_usage=rng.uniform(0.0, 0.9),
            active_adapters=frozenset({f"lora-{i % 4}"}),
            max_adapters=4,
            block_size=16,
            num_gpu_blocks=30_000,
            updated_at=now - rng.uniform(0.0, 0.05),
        )
        ep = Endpoint(f"pod-{i}", f"10.{i // 65536}.{(i // 256) % 256}.{i % 256}", 8000)
        pool.append(EndpointState(ep, metrics))
    return pool


# Decisions between two scrapes of an endpoint: 50 ms at the benchmark's 1 ms per decision,
# the EPP's default scrape interval.
SCRAPE_EVERY = 50


def rescrape(pool: list[EndpointState], now: float, rng: random.Random, part: int) -> None:
    """A new scrape (the same loads, taken just before `now`) of every `SCRAPE_EVERY`-th
    endpoint of `pool`, from the `part`-th on, in place."""
    for i in range(part % SCRAPE_EVERY, len(pool), SCRAPE_EVERY):
        s = pool[i]
        stamp = now - rng.uniform(0.0, 0.005)
        pool[i] = dataclasses.replace(s, metrics=dataclasses.replace(s.metrics, updated_at=stamp))


def run(preset: str, n: int, decisions: int, warmup: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    now = 1000.0
    scheduler = build_scheduler(preset_config(preset), rng=random.Random(seed))
    learns = scheduler.observes_first_tokens
    tracker = InflightTracker()
    admission = AdmissionController()
    pool = make_pool(rng, n, now)
    scrapes = random.Random(seed + 1)  # its own, so the requests are those of before
    systems = [text(rng, rng.randint(1500, 5000)) for _ in range(64)]
    tails = [text(rng, rng.randint(500, 3000)) for _ in range(256)]

    def request(k: int) -> LLMRequest:
        prompt = rng.choice(systems) + rng.choice(tails)
        return LLMRequest(f"r{k}", "llama", "llama", prompt=prompt, prompt_tokens=len(prompt) // 4)

    sched_ns: list[int] = []
    sched_cpu_ns: list[int] = []
    path_ns: list[int] = []
    inflight: list[str] = []
    answered: collections.deque[tuple[str, str]] = collections.deque()
    for k in range(warmup + decisions):
        req = request(k)
        now += 0.001
        rescrape(pool, now, scrapes, k)
        t0 = time.perf_counter_ns()
        states = tracker.apply(pool)
        admission.decide(req, states, now=now)
        t1 = time.perf_counter_ns()
        c1 = time.thread_time_ns()
        result = scheduler.schedule(req, states, now=now)
        c2 = time.thread_time_ns()
        t2 = time.perf_counter_ns()
        tracker.start(req.request_id, result.primary.key, req.prompt_tokens, now)
        t3 = time.perf_counter_ns()
        if learns:  # a first token per decision (untimed), so a learning scorer is active:
            # that of the decision n/2 earlier, so that, as in a busy pool, about half the
            # endpoints wait for a first token (the prefill-backlog scorer's map is that full)
            answered.append((req.request_id, result.primary.key))
            if len(answered) > n // 2:
                rid, key = answered.popleft()
                scheduler.observe_first_token(rid, key, now)
        inflight.append(req.request_id)
        if len(inflight) > 2 * n:  # keep roughly two requests per endpoint in flight
            tracker.finish(inflight.pop(0))
        if k >= warmup:
            sched_ns.append(t2 - t1)
            sched_cpu_ns.append(c2 - c1)
            path_ns.append((t1 - t0) + (t2 - t1) + (t3 - t2))
    return {
        "schedule_p50": pct(sched_ns, 50),
        "schedule_p99": pct(sched_ns, 99),
        "schedule_mean": statistics.fmean(sched_ns) / 1e3,
        "cpu_p50": pct(sched_cpu_ns, 50),
        "cpu_p99": pct(sched_cpu_ns, 99),
        "path_p50": pct(path_ns, 50),
        "path_p99": pct(path_ns, 99),
        "index_entries": float(scheduler_index_size(scheduler)),
    }


def scheduler_index_size(scheduler: object) -> int:
    from poolkeeper.scheduling.plugins.prefix_scorer import PrefixCacheScorer

    plugins = getattr(scheduler, "plugins", {})
    return sum(p.index.size for p in plugins.values() if isinstance(p, PrefixCacheScorer))


def pct(values: list[int], q: float) -> float:
    """The q-th percentile in microseconds (nearest rank)."""
    ordered = sorted(values)
    idx = min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))
    return ordered[idx] / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", action="append", choices=sorted(PRESETS))
    ap.add_argument("--sizes", default="10,100,1000")
    ap.add_argument("--decisions", type=int, default=3000)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs per preset and size; the run with the lowest CPU p99 is reported (on a "
        "shared machine the others mostly measure other processes)",
    )
    args = ap.parse_args()
    presets = args.preset or ["default", "gie-v1-default"]
    print(f"python {platform.python_version()} on {platform.machine()}, {platform.processor()}")
    print(
        f"decisions per size: {args.decisions} (after {args.warmup} warm-up), GC on, "
        f"best CPU p99 of {args.repeat} run(s)\n"
    )
    print(
        "| preset | endpoints | schedule p50 µs | schedule p99 µs | schedule CPU p50 µs "
        "| schedule CPU p99 µs | decision path p50 µs | decision path p99 µs "
        "| prefix index entries |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for preset in presets:
        for n in (int(s) for s in args.sizes.split(",")):
            runs = [
                run(preset, n, args.decisions, args.warmup, args.seed) for _ in range(args.repeat)
            ]
            r = min(runs, key=lambda x: x["cpu_p99"])
            print(
                f"| {preset} | {n} | {r['schedule_p50']:.0f} | {r['schedule_p99']:.0f} | "
                f"{r['cpu_p50']:.0f} | {r['cpu_p99']:.0f} | "
                f"{r['path_p50']:.0f} | {r['path_p99']:.0f} | {r['index_entries']:.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
