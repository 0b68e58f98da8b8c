"""Live EPP replicas: N `poolkeeper serve --no-envoy` behind one Envoy, approximate vs exact.

The shipped Kubernetes shape (docs/kubernetes.md): one gateway (Envoy) whose ext_proc cluster
holds every EPP replica; Envoy opens one ext_proc stream per request and balances the streams
round-robin over the replicas, so each replica routes about 1/N of the requests and its
approximate prefix index knows only those. Here: a simulated fleet publishing vLLM-format
KV-cache events (`poolkeeper sim --kv-events-port-offset`), N EPPs with the same config (own
ports), and one Envoy from `poolkeeper envoy-config` with the other replicas' ext_proc ports
added to its `epp` cluster. Index `approx`: the default profile; `exact`: the default with the
prefix scorer's `kvEvents` on (each replica subscribes to every server's events);
`exact-cold` / `exact-peers`: + cold affinity, always / once another replica is seen;
`exact-bal`: + bounded-load cold affinity, `exact-strong`: the same pushed harder;
`exact-hash`: a `cold-placement-filter` instead (a new prefix to its ring owner within a load
band, a hard pick), `exact-hashbal`: + its bounded load on the engines' reports,
`exact-hashpend`: + the replica's own unreported sends, `exact-hashbalx`: `exact-hashbal` whose
cold test reads only the engines' reports, `exact-hashblog` / `exact-hashwait`: with the
backlog scorer / and the scraped queues, `exact-hashblogpend` with the backlog scorer and
`pendingHeads`, `exact-hashblogkeep` with `keepPlaced` too, any of them + `-nospeed` without
the observed-speed scorer (`scheduling()`); any index + `-sync`: with
cross-replica sync (`spec.replicaSync`: every EPP a peer of the others on 127.0.0.1, one key
file), `-syncnow` with peers' batches waking flow control at once, `-syncms` as sync was
before decisions were sent at once and peers' unseen sends counted. `N/M:index` runs M EPPs with
only N behind Envoy: the idle ones scrape and take CPU as extra replicas do, a control on a
machine with few cores. Variants run interleaved (listed order in even rounds, reversed in
odd), the same requests each time; every run goes to OUT/runs.json with its requests, prefills,
load average and the CPU seconds of the fleet and of each EPP during the load, and each
process's run-queue wait. At the end (or with `--analyze RUNS_JSON...` on earlier batches)
every variant is compared with `--base` (default the first variant): the pooled and the paired
p90 ratio with 95 % bootstrap intervals over rounds (`bench/results/paired.py`). Example
(docs/notes/2026-12-06-exact-prefix-replicas-fourth-round.md):

    .venv/bin/python scripts/live_replicas.py --out bench-results/replicas --rounds 8 \\
        1/4:approx 4:exact-strong 1:approx
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from poolkeeper.bench.fleet.replica_router import with_cold_placement
from poolkeeper.bench.live.live import LiveSpec, live_arrivals, live_scenario, prefill_count
from poolkeeper.bench.live.live_processes import READY_TIMEOUT_S, process, wait_http
from poolkeeper.bench.live.live_targets import envoy_binary, models_of, poolkeeper_config
from poolkeeper.bench.live.loadgen import run_open_loop
from poolkeeper.bench.results.metrics import SLO, summarize
from poolkeeper.bench.results.paired import compare, quantile
from poolkeeper.bench.workload.scenarios import adapter_names
from poolkeeper.bench.workload.workload_spec import default_spec
from poolkeeper.errors import ConfigError
from poolkeeper.netutil import free_ports
from poolkeeper.scheduling.presets import preset_document

KV_OFFSET = 1000
NAMES = ("http", "extproc", "metrics", "health", "admin")


INDEXES = (
    "approx", "exact", "exact-cold", "exact-peers", "exact-bal", "exact-strong", "exact-hash",
    "exact-hashbal", "exact-hashpend", "exact-hashbalx", "exact-hashblog", "exact-hashwait",
    "exact-hashblogpend", "exact-hashblogkeep",
)  # fmt: skip


def scheduling(index: str) -> dict[str, Any] | None:
    """`approx`: the default; `exact`: + KV events; `exact-cold`: + cold affinity 0.2 (a new
    long prefix scored toward its owner on a hash ring of the endpoints, the same for every
    replica; docs/scheduling.md); `exact-peers`: cold affinity only once the events show
    another replica's traffic (`coldAffinityPeersOnly`); `exact-bal`: `exact-cold` with
    `coldAffinityBalance: 1` (the first endpoint on the ring holding fewer than its share of
    the prefixes); `exact-strong`: `exact-bal` with `coldAffinity: 1` (the owner's push, 3
    with the default's weight, is not overruled by the replicas' differing load views);
    `exact-hash`: `exact` with a `cold-placement-filter` (a new long prefix goes to its ring
    owner within a load band; no score push); `exact-hashbal`: with its `balance: 1`;
    `exact-hashpend`: and `pendingHeads` (the replica's own unreported sends count);
    `exact-hashbalx`: `exact-hashbal` with `ownPlacements: false` (a prefix is cold until its
    engine reports it, in the replica that placed it too); `exact-hashblog`: `exact-hashbal`
    with `backlogScorer` (an owner busy prefilling is out of the band); `exact-hashwait`:
    `exact-hashblog` with `scrapedWaiting` (an endpoint whose scrape shows a queue counts as
    busy prefilling, in the band and the hold); `exact-hashblogpend`: `exact-hashblog` with
    `pendingHeads` (what cross-replica sync measured best with in virtual time: peers' sends
    count as pending heads too); `exact-hashblogkeep`: `exact-hashblogpend` with `keepPlaced` (a
    placed prefix goes only to the endpoints holding it). Any index + `-nospeed`: without the
    `observed-speed-scorer`. Any index (+ `-nospeed`) + `-sync` (e.g. `exact-hashwait-sync`):
    the same with cross-replica sync on, `-syncnow`: and peers' batches waking flow control at
    once (`SYNCS`), `-syncspread`: peers' wakes spread over 100 ms, `-syncclaim`: with
    `claimGraceMs` 5 (`-syncclaim2` / `-syncclaim10`: 2 / 10 ms, `-syncnoclaim`: 0)."""
    index, slow = split_speed(split_sync(index)[0])
    if index == "approx" and not slow:
        return None
    if index not in INDEXES:
        raise SystemExit(f"unknown index {index!r} ({', '.join(INDEXES)}, each + a sync suffix)")
    doc = preset_document("default")
    if slow:
        doc = without_speed(doc)
    for plugin in doc["plugins"]:
        if plugin["type"] == "prefix-cache-scorer" and index != "approx":  # approx-nospeed
            plugin["parameters"].update({"kvEvents": True, "kvEventsPortOffset": KV_OFFSET})
            if index in ("exact-cold", "exact-peers", "exact-bal"):
                plugin["parameters"]["coldAffinity"] = 0.2
            if index == "exact-strong":
                plugin["parameters"]["coldAffinity"] = 1.0
            if index in ("exact-bal", "exact-strong"):
                plugin["parameters"]["coldAffinityBalance"] = 1.0
            if index == "exact-peers":
                plugin["parameters"]["coldAffinityPeersOnly"] = True
    placement: dict[str, dict[str, Any]] = {"exact-hash": {}, "exact-hashbal": {"balance": 1.0},
                 "exact-hashpend": {"balance": 1.0, "pendingHeads": True},
                 "exact-hashbalx": {"balance": 1.0, "ownPlacements": False},
                 "exact-hashblog": {"balance": 1.0,
                                    "backlogScorer": "prefill-backlog-scorer"},
                 "exact-hashwait": {"balance": 1.0, "scrapedWaiting": True,
                                    "backlogScorer": "prefill-backlog-scorer"},
                 "exact-hashblogpend": {"balance": 1.0, "pendingHeads": True,
                                        "backlogScorer": "prefill-backlog-scorer"},
                 "exact-hashblogkeep": {"balance": 1.0, "pendingHeads": True,
                                        "backlogScorer": "prefill-backlog-scorer",
                                        "keepPlaced": True}}  # fmt: skip
    if index in placement:
        doc = with_cold_placement(doc, placement[index])
    return doc


NOSPEED = "-nospeed"


def split_speed(index: str) -> tuple[str, bool]:
    """The index without `-nospeed`, and whether it had it (the profile then runs without its
    `observed-speed-scorer`: each replica measures speeds from its own requests only, the
    input its warm placements differ by; docs/notes/2026-12-07-cold-start-doubles.md)."""
    return index.removesuffix(NOSPEED), index.endswith(NOSPEED)


def without_speed(doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` without its `observed-speed-scorer` (plugin and profile references)."""
    speed = "observed-speed-scorer"
    profiles = [
        {**prof, "plugins": [r for r in prof["plugins"] if r["pluginRef"] != speed]}
        for prof in doc["schedulingProfiles"]
    ]
    plugins = [p for p in doc["plugins"] if p["type"] != speed]
    return {**doc, "plugins": plugins, "schedulingProfiles": profiles}


SYNC = "-sync"
# Index suffix -> replicaSync settings beyond `sync_section`'s: `-sync` the defaults (with
# `claimGraceMs`' default since docs/notes/2026-12-07-claim-default.md: 5 ms, as `-syncclaim`),
# `-syncnow` a peer's batch wakes flow control's held requests at once (no spread),
# `-syncms` decisions gathered for the flush interval and the peers' unseen sends not counted
# (sync before docs/notes/2026-12-07-replicas-sub-ms.md), `-syncspread` peers' wakes spread
# over 100 ms, not 20 (docs/notes/2026-12-07-uneven-start.md), `-syncclaim` the room a peer's
# first byte opens claimed for 5 ms (`claimGraceMs`, docs/notes/2026-12-07-release-claim.md),
# `-syncclaim2` / `-syncclaim10` for 2 / 10 ms, `-syncnoclaim` without a claim (0 ms: the default
# before docs/notes/2026-12-07-claim-default.md).
SYNCS: dict[str, dict[str, Any]] = {
    "-syncclaim": {"claimGraceMs": 5},
    "-syncclaim2": {"claimGraceMs": 2},
    "-syncclaim10": {"claimGraceMs": 10},
    "-syncnoclaim": {"claimGraceMs": 0},
    "-syncnow": {"peerWakeSpreadMs": 0},
    "-syncms": {"sendAtOnce": False, "peerUnseen": False},
    "-syncspread": {"peerWakeSpreadMs": 100},
    SYNC: {},
}


def split_sync(index: str) -> tuple[str, dict[str, Any] | None]:
    """The index without its sync suffix, and that suffix's settings (None: no sync)."""
    for suffix, settings in SYNCS.items():
        if index.endswith(suffix):
            return index.removesuffix(suffix), settings
    return index, None


def valid_index(index: str) -> bool:
    return split_speed(split_sync(index)[0])[0] in INDEXES


def sync_section(port: int, ports: list[int], key: Path, **extra: Any) -> dict[str, Any]:
    """`spec.replicaSync` of one EPP: on 127.0.0.1 at `port`, every EPP's port a peer (its own
    is left out), the shared key in `key`, and `extra`."""
    return {"enabled": True, "address": "127.0.0.1", "port": port, "keyFile": str(key),
            "peers": [f"127.0.0.1:{p}" for p in ports], **extra}  # fmt: skip


def sync_counters(metrics_port: int) -> dict[str, float]:
    """An EPP's `poolkeeper_replica_sync_*` samples (name without the prefix, labels kept)."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    prefix = "poolkeeper_replica_sync_"
    out = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            name, _, value = line.rpartition(" ")
            out[name.removeprefix(prefix)] = float(value)
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc; 0 where unreadable)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def runqueue_wait_s(pid: int) -> float:
    """Seconds the threads of `pid` have spent runnable but waiting for a CPU (Linux
    /proc/PID/task/*/schedstat, second field; 0 where unreadable). Why: on a shared machine a
    process that waits for a core delays every request it handles, whatever the router chose;
    this says how starved each run was, independently of its TTFTs."""
    total = 0
    for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        try:
            total += int(stat.read_text().split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return total / 1e9


def bootstrap(cfg: Path, extra_extproc: list[int], out: Path) -> None:
    text = subprocess.run(
        [sys.executable, "-m", "poolkeeper", "envoy-config", "-f", str(cfg)],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    doc = json.loads(text)
    (epp,) = [c for c in doc["static_resources"]["clusters"] if c["name"] == "epp"]
    lb = epp["load_assignment"]["endpoints"][0]["lb_endpoints"]
    for port in extra_extproc:
        lb.append(
            {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1",
                                                         "port_value": port}}}}
        )  # fmt: skip
    out.write_text(json.dumps(doc))


def parse_variant(variant: str) -> tuple[int, int, str]:
    """`N:index` (N replicas behind Envoy) or `N/M:index` (M EPPs running, only the first N
    behind Envoy: the others idle, scraping, as a control for the CPU extra replicas take)."""
    counts, _, index = variant.partition(":")
    active, _, running = counts.partition("/")
    running = running or active
    if not (active.isdigit() and running.isdigit()) or not 1 <= int(active) <= int(running):
        raise SystemExit(f"bad variant {variant!r}: N[/M]:{'|'.join(INDEXES)}, 1 <= N <= M")
    if not valid_index(index):
        raise SystemExit(
            f"bad variant {variant!r}: index one of {', '.join(INDEXES)}, each optionally "
            f"+ {' or '.join(SYNCS)}"
        )
    return int(active), int(running), index


def run_variant(spec: LiveSpec, arrivals: list[Any], variant: str, work: Path) -> dict[str, Any]:
    replicas, running, index = parse_variant(variant)
    kind = default_spec(spec.workload, spec.servers).kind
    models = models_of(kind, adapter_names(default_spec(spec.workload, spec.servers)))
    sim_ports = free_ports(spec.servers, consecutive=True)
    sim_cmd = [sys.executable, "-m", "poolkeeper", "sim", "--count", str(spec.servers),
               "--port", str(sim_ports[0]), "--model", "base-model",
               "--time-scale", str(spec.time_scale), "--seed", str(spec.seed),
               "--kv-events-port-offset", str(KV_OFFSET),
               "--stream-interval", str(spec.stream_interval)]  # fmt: skip
    work.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        sim = stack.enter_context(process(sim_cmd, work / "sim.log"))
        for p in sim_ports:
            wait_http(f"http://127.0.0.1:{p}/health", lambda s: s == 200, READY_TIMEOUT_S, "sim")
        ports = [dict(zip(NAMES, free_ports(len(NAMES)), strict=True)) for _ in range(running)]
        synced = split_sync(index)[1]
        sync_ports = free_ports(running) if synced is not None else []
        key_file = work / "sync.key"
        key_file.write_text(secrets.token_hex(32))
        key_file.chmod(0o600)
        cfgs = []
        epps = []
        for i, pp in enumerate(ports):
            cfg = poolkeeper_config(work / f"epp{i}", sim_ports, pp, models, scheduling(index))
            if sync_ports:
                section = sync_section(sync_ports[i], sync_ports, key_file, **(synced or {}))
                with (cfg / "gateway.yaml").open("a") as gateway:
                    gateway.write(f"  replicaSync: {json.dumps(section)}\n")
            cfgs.append(cfg)
            cmd = [sys.executable, "-m", "poolkeeper", "serve", "--no-envoy", "-f", str(cfg),
                   "--workdir", str(work / f"serve{i}"), "--log-level", "warning"]  # fmt: skip
            epps.append(stack.enter_context(process(cmd, work / f"epp{i}.log")))
        for pp in ports:
            wait_http(f"http://127.0.0.1:{pp['metrics']}/readyz", lambda s: s == 200,
                      READY_TIMEOUT_S, "epp")  # fmt: skip
        boot = work / "envoy.json"
        bootstrap(cfgs[0], [pp["extproc"] for pp in ports[1:replicas]], boot)
        envoy = envoy_binary()
        assert envoy is not None
        cmd = [envoy, "-c", str(boot), "--concurrency", "1", "--log-level", "warn",
               "--disable-hot-restart"]  # fmt: skip
        proxy = stack.enter_context(process(cmd, work / "envoy.log"))
        http = ports[0]["http"]
        wait_http(f"http://127.0.0.1:{http}/v1/models", lambda s: s < 500, READY_TIMEOUT_S, "envoy")
        time.sleep(1.0)
        before = list(os.getloadavg())
        procs = (sim, proxy, *epps)
        cpu0 = [cpu_seconds(p.pid) for p in procs]
        wait0 = [runqueue_wait_s(p.pid) for p in procs]
        t0 = time.monotonic()
        results = asyncio.run(
            run_open_loop(f"http://127.0.0.1:{http}", arrivals, time_limit=spec.duration + 5,
                          stop_after_first_tokens=True, request_timeout=120.0)
        )  # fmt: skip
        wall = time.monotonic() - t0
        cpu = [round(cpu_seconds(p.pid) - c, 2) for p, c in zip(procs, cpu0, strict=True)]
        # Share of the run each process spent waiting for a core (its threads summed).
        wait = [
            round((runqueue_wait_s(p.pid) - w) / wall, 3) for p, w in zip(procs, wait0, strict=True)
        ]
        sync = [sync_counters(pp["metrics"]) for pp in ports] if sync_ports else []
    outcomes = [r.outcome for r in results]
    errors: dict[str, int] = {}
    for r in results:
        if r.status != 200 or r.error:
            key = r.error or f"HTTP {r.status}"
            errors[key] = errors.get(key, 0) + 1
    return {
        "replicas": replicas,
        "epps_running": running,
        "index": index,
        "summary": summarize(outcomes, duration=spec.duration, slo=SLO()),
        "errors": errors,
        "prefills": prefill_count(outcomes),
        "load_before": before,
        "load_average": list(os.getloadavg()),
        # CPU seconds during the load: the simulated fleet, then each EPP replica.
        "cpu_s": {"sim": cpu[0], "envoy": cpu[1], "epps": cpu[2:]},
        # Seconds waiting for a core per second of the run, per process (starvation).
        "runqueue_wait": {"sim": wait[0], "envoy": wait[1], "epps": wait[2:]},
        # Per EPP with sync on: its poolkeeper_replica_sync_* counters at the end of the load.
        "sync": sync,
        "requests": [
            [round(o.arrival, 4), o.group, o.server, None if o.ttft is None else round(o.ttft, 4)]
            for o in sorted(outcomes, key=lambda o: o.arrival)
        ],
    }


COLD_S = 5.0  # requests arriving before this are the cold start (every prefix's first prefill)


def run_stats(run: dict[str, Any]) -> dict[str, Any]:
    """One run's diagnostics from its requests: p90 TTFT of the cold start and after it, the
    groups whose requests went to more than one server (each extra server prefilled the
    prefix again), and the most any process waited for a core (share of the run)."""
    reqs = [r for r in run["requests"] if r[3] is not None]
    cold = [r[3] for r in reqs if r[0] < COLD_S]
    steady = [r[3] for r in reqs if r[0] >= COLD_S]
    servers: dict[Any, set[Any]] = {}
    for _arrival, group, server, _ttft in reqs:
        if group and server:
            servers.setdefault(group, set()).add(server)
    wait = run.get("runqueue_wait")
    starved = max([wait["sim"], wait["envoy"], *wait["epps"]]) if wait else None
    return {
        "cold_p90": quantile(cold, 0.9) if cold else None,
        "steady_p90": quantile(steady, 0.9) if steady else None,
        "split_groups": sum(1 for s in servers.values() if len(s) > 1),
        "max_wait": starved,
    }


def fmt(values: list[float | None]) -> str:
    return " ".join("-" if x is None else f"{x:.2f}" for x in values)


def analyze(runs: list[dict[str, Any]], base: str, *, starved: float) -> None:
    """Each variant against `base`, round by round (`paired.compare`: the pooled and the
    paired p90 ratio with 95 % bootstrap intervals over rounds), over all rounds and over the
    rounds where no process of either run waited for a core more than `starved` of the time."""
    by_round: dict[Any, dict[str, dict[str, Any]]] = {}
    for run in runs:
        by_round.setdefault(run["round"], {})[run["label"]] = run
    labels = list(dict.fromkeys(r["label"] for r in runs))
    for label in labels:
        mine = [r for r in runs if r["label"] == label]
        stats = [run_stats(r) for r in mine]
        print(f"{label:>12}: p90 {fmt([r['summary']['ttft_s']['p90'] for r in mine])} | "
              f"cold p90 {fmt([s['cold_p90'] for s in stats])} | steady p90 "
              f"{fmt([s['steady_p90'] for s in stats])} | prefills {[r['prefills'] for r in mine]}"
              f" split {[s['split_groups'] for s in stats]} | max core wait "
              f"{fmt([s['max_wait'] for s in stats])}")  # fmt: skip
    for label in labels:
        if label == base:
            continue
        pairs = [(rs[base], rs[label]) for rs in by_round.values() if base in rs and label in rs]
        calm = [
            (b, v) for b, v in pairs
            if all((w := run_stats(x)["max_wait"]) is None or w <= starved for x in (b, v))
        ]  # fmt: skip
        for name, chosen in (("all rounds", pairs), (f"core wait <= {starved:g}", calm)):
            if len(chosen) < 2:
                print(f"{label} / {base}, {name}: {len(chosen)} round(s), no interval")
                continue
            ttfts = [[[r[3] for r in x["requests"] if r[3] is not None] for x in pair]
                     for pair in chosen]  # fmt: skip
            c = compare([t[0] for t in ttfts], [t[1] for t in ttfts])
            print(f"{label} / {base}, {name} ({c.rounds} rounds): p90 pooled {c.pooled}, "
                  f"paired {c.paired}; per round "
                  f"{' '.join(f'{x:.2f}' for x in c.per_round)}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="directory for runs.json (required to run)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--spec", default='{"groups": 16, "time_scale": 10, "duration": 30, '
                    '"stream_interval": 8}', help="LiveSpec fields as JSON")  # fmt: skip
    ap.add_argument("--analyze", type=Path, nargs="+", metavar="RUNS_JSON",
                    help="only compare the runs of these runs.json files (rounds of several "
                    "files are kept apart) against --base")  # fmt: skip
    ap.add_argument(
        "--base",
        help="the variant the others are compared with (default: the "
        "first variant listed, or with --analyze the first run's)",
    )
    ap.add_argument("--starved", type=float, default=0.25,
                    help="a round counts as CPU-starved when a process of it waited for a core "
                    "more than this share of the run (default 0.25)")  # fmt: skip
    ap.add_argument(
        "variants",
        nargs="*",
        help=f"N[/M]:{'|'.join(INDEXES)}[{SYNC}], e.g. 2:exact, 1/4:approx, 4:exact-hashwait-sync",
    )
    args = ap.parse_args()
    for variant in args.variants:
        parse_variant(variant)
    if args.analyze:
        runs = []
        for i, path in enumerate(args.analyze):
            for run in json.loads(path.read_text())["runs"]:
                runs.append({**run, "round": (i, run["round"])})
        if not runs:
            raise SystemExit("no runs in " + ", ".join(map(str, args.analyze)))
        analyze(runs, args.base or runs[0]["label"], starved=args.starved)  # fmt: skip
        return
    if args.out is None or not args.variants:
        raise SystemExit("give --out and at least one variant (or --analyze RUNS_JSON)")
    # A plain `kill` must still stop the fleet and routers (their `finally` blocks).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    spec = LiveSpec(**{"peers": (), **json.loads(args.spec)})
    arrivals, rate, _capacity = live_arrivals(spec, live_scenario(spec))
    print(f"{len(arrivals)} requests at {rate:.2f} req/s", flush=True)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    with tempfile.TemporaryDirectory(prefix="live-replicas-") as tmp:
        for rnd in range(args.rounds):
            for variant in args.variants if rnd % 2 == 0 else args.variants[::-1]:
                name = variant.replace("/", "of").replace(":", "-")
                try:
                    run = run_variant(spec, arrivals, variant, Path(tmp) / f"r{rnd}-{name}")
                except ConfigError as exc:  # a start-up timeout on an overloaded machine
                    print(f"  {variant}: {exc}; once more in 10 s", flush=True)
                    time.sleep(10.0)
                    run = run_variant(spec, arrivals, variant, Path(tmp) / f"r{rnd}-{name}b")
                run.update({"round": rnd, "label": variant, "spec": json.loads(args.spec)})
                t = run["summary"]["ttft_s"]
                load = f"{run['load_before'][0]:.1f} -> {run['load_average'][0]:.1f}"
                print(f"  {variant}: p90 {t['p90']:.3f} s, p99 {t['p99']:.3f} s, prefills "
                      f"{run['prefills']}, errors {run['errors'] or 0}, load {load}, "
                      f"cpu {run['cpu_s']}, core wait {run['runqueue_wait']}",
                      flush=True)  # fmt: skip
                for i, counters in enumerate(run["sync"]):
                    got = {k: v for k, v in counters.items() if v and "_created" not in k}
                    print(f"    sync epp{i}: {got}", flush=True)
                runs.append(run)
                (out / "runs.json").write_text(json.dumps({"rate": rate, "runs": runs}))
    analyze(runs, args.base or args.variants[0], starved=args.starved)


if __name__ == "__main__":
    main()
