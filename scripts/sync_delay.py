"""How long a replica's decision takes to reach a peer's fold, over replica sync's real UDP path.

Two processes on 127.0.0.1, each one replica's hub, `SyncTransport` (uvloop, as `serve`), codec
and `PeerUnseen`: each makes Poisson decisions at `--rate` per second, spinning `--work-us` (the
route's own work) before publishing a `Sent` of 44 blocks, then an `Answered` 20-60 ms and an
`Ended` 100-500 ms later. Measured: from the publish to the end of the peer's `deliver` (hub and
`PeerUnseen` folded), on `time.monotonic` (one clock for both processes); datagrams per request
and peer; the two processes' CPU per request. Modes, interleaved per round: `timer` (every event
gathered for `flushIntervalMs` 1 ms: sync before `sendAtOnce`), `at-once` (`sendAtOnce`: a
decision on the loop's next turn, the rest gathered), `soon` (`flushIntervalMs: 0`).
docs/notes/2026-12-07-replicas-sub-ms.md has the numbers; record `uptime` beside them.

    .venv/bin/python scripts/sync_delay.py --rounds 3 --seconds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import uvloop

from poolkeeper.netutil import free_ports
from poolkeeper.scheduling.replicasync.codec import Codec
from poolkeeper.scheduling.replicasync.events import Answered, Batch, Ended, Sent, SyncEvent
from poolkeeper.scheduling.replicasync.peerunseen import PeerUnseen
from poolkeeper.scheduling.replicasync.transport import SyncTransport
from poolkeeper.server.replica_sync import _SignallingSync, notifier

MODES = ("timer", "at-once", "soon")
KEY = b"sync-delay-measurement-key-0123456789"


def _spin(us: float) -> None:
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        pass


async def _replica(
    name: str, port: int, peer: int, mode: str, args: argparse.Namespace
) -> dict[str, object]:
    loop = asyncio.get_running_loop()
    hub = _SignallingSync(name)
    hub.bind(PeerUnseen())
    folded: dict[str, float] = {}

    def deliver(batch: Batch, now: float) -> bool:
        taken = hub.deliver(batch, now)
        at = time.monotonic()
        for event in batch.events:
            if isinstance(event, Sent):
                folded[event.request_id] = at
        return taken

    flush_s = 0.0 if mode == "soon" else 0.001
    transport = SyncTransport(Codec(KEY), name, hub.take, deliver, flush_interval_s=flush_s)
    await transport.start("127.0.0.1", port)
    transport.set_peers([("127.0.0.1", peer)])
    hub.on_publish = notifier(transport, mode == "at-once")
    await asyncio.sleep(0.5)  # the peer's socket is up
    rng = random.Random(name)
    published: dict[str, float] = {}

    def later(event: SyncEvent) -> None:
        _spin(args.work_us / 3)
        hub.publish(event)

    def decide(rid: str) -> None:
        _spin(args.work_us)
        published[rid] = time.monotonic()
        blocks = tuple(rng.getrandbits(63) for _ in range(44))
        hub.publish(Sent(rid, f"10.0.0.{rng.randrange(8)}:8000", 700, True, blocks))
        loop.call_later(rng.uniform(0.02, 0.06), later, Answered(rid))
        loop.call_later(rng.uniform(0.1, 0.5), later, Ended(rid))

    cpu0, start, sent0 = time.process_time(), time.monotonic(), transport.stats.datagrams_sent
    n = 0
    while time.monotonic() - start < args.seconds:
        await asyncio.sleep(rng.expovariate(args.rate))
        n += 1
        loop.call_soon(decide, f"{name}-{n}")
    await asyncio.sleep(0.7)  # the last ends
    out = {
        "published": published, "folded": folded, "n": n, "cpu": time.process_time() - cpu0,
        "datagrams": transport.stats.datagrams_sent - sent0,
    }  # fmt: skip
    transport.close()
    return out


def _child(argv: list[str]) -> None:
    name, port, peer, mode, path = argv[:5]
    args = _parser().parse_args(argv[5:])
    result = uvloop.run(_replica(name, int(port), int(peer), mode, args))
    Path(path).write_text(json.dumps(result))


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _round(mode: str, args: argparse.Namespace, rest: list[str], tmp: Path) -> str:
    ports = free_ports(2)
    paths = [tmp / f"{mode}-a.json", tmp / f"{mode}-b.json"]
    children = []
    for name, port, peer, path in (
        ("a", ports[0], ports[1], paths[0]),
        ("b", ports[1], ports[0], paths[1]),
    ):
        command = [sys.executable, __file__, "--child", name, str(port), str(peer), mode, str(path)]
        children.append(subprocess.Popen([*command, *rest]))
    for child in children:
        child.wait()
    a, b = (json.loads(path.read_text()) for path in paths)
    delays = [
        (dst["folded"][rid] - at) * 1000
        for src, dst in ((a, b), (b, a))
        for rid, at in src["published"].items()
        if rid in dst["folded"]
    ]
    n = a["n"] + b["n"]
    return (
        f"{mode:8} n {n} lost {n - len(delays)} ms p50 {_quantile(delays, 0.5):.2f} "
        f"p90 {_quantile(delays, 0.9):.2f} p99 {_quantile(delays, 0.99):.2f} "
        f"mean {statistics.mean(delays):.2f} | datagrams/request/peer "
        f"{(a['datagrams'] + b['datagrams']) / n:.2f} | cpu ms/request "
        f"{(a['cpu'] + b['cpu']) * 1000 / n:.3f}"
    )


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rate", type=float, default=135.0, help="decisions per second per replica")
    ap.add_argument("--work-us", type=float, default=150.0, help="the route's work per decision")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    return ap


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        _child(sys.argv[2:])
        return
    args = _parser().parse_args()
    if not (0 < args.seconds <= 60 and 0 < args.rate <= 2000 and 1 <= args.rounds <= 10):
        raise SystemExit("--seconds 0-60, --rate 0-2000, --rounds 1-10 (a bounded measurement)")
    rest = ["--seconds", str(args.seconds), "--rate", str(args.rate), "--work-us",
            str(args.work_us)]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="sync-delay-") as tmp:
        for r in range(args.rounds):
            for mode in args.modes:
                print(f"round {r} {_round(mode, args, rest, Path(tmp))}", flush=True)
    print("load average", Path("/proc/loadavg").read_text().split()[:3])


if __name__ == "__main__":
    main()
