"""Phantom entries of cross-replica sync under datagram loss, in virtual time.

One sender replica and one receiver, the hub and backlog code as the EPP runs them
(`scheduling/replicasync/hub.py`, `scheduling/backlog.py`), the channel between them lossy (and
optionally reordering). A phantom is an entry the receiver's backlog holds for the sender that
the sender's own backlog no longer counts: its `Answered` or `Ended` was lost. Without open
statements it lives until the backlog's 60 s age limit; with them, until the next statement.
`false_drops` counts entries a statement removed while the sender still had them open (must be
0). docs/notes/2026-12-07-replica-sync-operations.md has the table.

    .venv/bin/python scripts/sync_phantoms.py [--duration 120] [--rate 20]
"""

from __future__ import annotations

import argparse
import json
import random

from poolkeeper.scheduling.backlog import PrefillBacklog
from poolkeeper.scheduling.replicasync.events import Answered, Batch, Ended, Sent, SyncEvent
from poolkeeper.scheduling.replicasync.hub import ReplicaSync
from poolkeeper.scheduling.replicasync.openset import digest

ENDPOINT = "10.0.0.1:8000"


class Receiver:
    """The fold's backlog part, counting drops of entries the sender still has open."""

    def __init__(self, sender: PrefillBacklog) -> None:
        self.backlog = PrefillBacklog()
        self.sender = sender
        self.false_drops = 0

    def fold(self, origin: str, event: SyncEvent, now: float) -> None:
        key = (origin, event.request_id)
        if isinstance(event, Sent):
            self.backlog.sent(key, event.endpoint, event.tokens, now, seen=event.seen)
        elif isinstance(event, Answered):
            self.backlog.first_token(key)
        else:
            if self.sender.endpoint_of(event.request_id) and self.backlog.endpoint_of(key):
                self.false_drops += 1
            self.backlog.ended(key)

    def peer_gone(self, origin: str) -> None:
        self.backlog.drop_origin(origin)


def run(
    loss: float,
    statements: bool,
    *,
    reorder: float = 0.0,
    seed: int = 1,
    duration: float = 120.0,
    rate: float = 20.0,
    flush: float = 0.01,
    interval: float = 1.0,
    room: int = 140,
) -> dict[str, float | bool]:
    rng = random.Random(seed)
    own = PrefillBacklog()  # the sender's own backlog: the truth
    out, hub = ReplicaSync("b"), ReplicaSync("a")
    out.bind_open(lambda: [digest(rid) for rid in own.own_ids()])
    receiver = Receiver(own)
    hub.bind(receiver)
    timeline: list[tuple[float, int, str]] = []  # (when, 0 sent / 1 first byte / 2 end, id)
    t, i = 0.0, 0
    while t < duration:
        t += rng.expovariate(rate)
        i += 1
        ttft = rng.uniform(0.2, 1.0)
        timeline += [
            (t, 0, f"r{i}"),
            (t + ttft, 1, f"r{i}"),
            (t + ttft + rng.uniform(2, 8), 2, f"r{i}"),
        ]
    timeline.sort()
    seq, k, now, next_statement, lost = 0, 0, 0.0, interval, 0
    held: Batch | None = None
    samples: list[int] = []
    while now < duration:
        now += flush
        while k < len(timeline) and timeline[k][0] <= now:
            _, kind, rid = timeline[k]
            k += 1
            if kind == 0:
                own.sent(rid, ENDPOINT, 1000, now)
                out.publish(Sent(rid, ENDPOINT, 1000, True))
            elif kind == 1 and own.first_token(rid, now):
                out.publish(Answered(rid))
            elif kind == 2 and own.ended(rid):
                out.publish(Ended(rid))
        taken = out.take()
        state = None
        if now >= next_statement:
            next_statement += interval
            state = out.statement(room) if statements else None
        if taken is not None or state is not None:
            seq += 1
            batch = Batch("b", seq, taken.events if taken else (), state)
            if rng.random() < loss:
                lost += 1
            elif held is None and rng.random() < reorder:
                held = batch  # delivered after the next one
            else:
                hub.deliver(batch, now)
                if held is not None:
                    hub.deliver(held, now)
                    held = None
        mirrored = sum(1 for rid in own.own_ids() if receiver.backlog.endpoint_of(("b", rid)))
        samples.append(len(receiver.backlog) - mirrored)
    half = samples[len(samples) // 2 :]  # the steady state (60 s age reached)
    return {
        "loss": loss,
        "reorder": reorder,
        "statements": statements,
        "datagrams_lost": lost,
        "phantoms_mean": round(sum(half) / len(half), 2),
        "phantoms_max": max(samples),
        "sender_open_end": len(own),
        "reconciled": hub.reconciled,
        "false_drops": receiver.false_drops,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=120.0)
    ap.add_argument("--rate", type=float, default=20.0, help="sender's requests per second")
    args = ap.parse_args()
    for loss, reorder in ((0.001, 0.0), (0.01, 0.0), (0.05, 0.0), (0.01, 0.2)):
        for statements in (False, True):
            row = run(loss, statements, reorder=reorder, duration=args.duration, rate=args.rate)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
