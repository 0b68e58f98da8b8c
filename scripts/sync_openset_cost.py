"""What cross-replica sync's open statements cost in CPU, per call (replicasync/openset.py).

One origin with `--tracked` sends, half of them ended (their `Ended` lost), 40 statements of
`--room` digests: the median time to build a statement (the sender, from its open sends), to
judge it (`OpenTracker.stale`, the receiver) and to track a send (`OpenTracker.sent`). Runs
against whichever `poolkeeper` is imported, so an A/B of two trees is two runs with
`PYTHONPATH` set to a `git archive` of the other's `src/` (the merged code took request ids,
this takes their digests: both are handled). Not a test: run it by hand, alternate the trees,
and record `uptime`.

    .venv/bin/python scripts/sync_openset_cost.py --tracked 65536
    PYTHONPATH=/tmp/base/src .venv/bin/python scripts/sync_openset_cost.py --tracked 65536
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import time

from poolkeeper.scheduling.replicasync import openset
from poolkeeper.scheduling.replicasync.openset import OpenTracker, digest, statement


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tracked", type=int, default=65_536)
    parser.add_argument("--room", type=int, default=140)
    parser.add_argument("--statements", type=int, default=40)
    args = parser.parse_args()
    ids = [f"req-{i}" for i in range(args.tracked)]
    still = ids[::2]
    takes_digests = "open_digests" in inspect.signature(statement).parameters
    source: list[int] | list[str] = [digest(i) for i in still] if takes_digests else still
    made, build = [], []
    for turn in range(1, args.statements + 1):
        start = time.perf_counter()
        made.append(statement(source, args.room, turn))  # type: ignore[arg-type]
        build.append(time.perf_counter() - start)
    tracker = OpenTracker()
    start = time.perf_counter()
    for rid in ids:
        tracker.sent("b", rid, 1)
    per_send = (time.perf_counter() - start) / len(ids)
    judge = []
    for s in made:
        assert s is not None
        start = time.perf_counter()
        tracker.stale("b", 1, s)
        judge.append(time.perf_counter() - start)
    shift = made[0].shift if made[0] is not None else None
    print(
        json.dumps(
            {
                "tree": openset.__file__,
                "tracked": args.tracked,
                "shift": shift,
                "statement_ms": round(statistics.median(build) * 1e3, 3),
                "stale_ms": round(statistics.median(judge) * 1e3, 3),
                "tracker_sent_us": round(per_send * 1e6, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
