"""What the exact prefix index costs per KV event and per routed request, this tree against
another (`--base`, e.g. the code before its bound), in interleaved rounds.

Each round runs every variant once, in a child process with that variant's `src` first on
PYTHONPATH, and prints nanoseconds per event for three streams on one endpoint:
- `honest`: an engine with a 28,000-block cache (the simulator's) reporting requests: a
  32-block prompt chain (a head), then four one-block continuations (decode), and removing its
  oldest blocks to stay at its cache size, so a bound of 31,250 is never reached;
- `flood`: stores of new 32-block chains and no removes (a hostile publisher), 200,000 blocks
  after the index is already at 100,000 (bounded: evicting on every store; unbounded: growing);
- `route`: a request's lookup (`match`), a 64-block prompt whose 48 leading blocks are held,
  with the endpoint at 9,600 blocks, and `route_full` at 31,200 (just under the bound).
Times are the child's CPU time (`process_time`), so that waiting for a core on a shared
machine does not count; ratios are per round (this tree / base), the order alternating. Usage:

    git archive <commit> src | tar -x -C /tmp/base
    python -m poolkeeper.bench.overhead.exact_index_cost --base /tmp/base/src --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

_CHILD = r"""
import json, random, time
from poolkeeper.kvevents import BlockRemoved, BlockStored, KVEventBatch
from poolkeeper.scheduling.exact_prefix import ExactPrefixIndex

rng = random.Random(1)
E = "10.0.0.1:8000"

def timed(index, warm, batches):
    # Events are made before the clock starts: the index's cost alone.
    for batch in warm:
        index.apply(E, batch, 1.0)
    apply = index.apply
    t = time.process_time_ns()
    for batch in batches:
        apply(E, batch, 1.0)
    return (time.process_time_ns() - t) / len(batches)

def honest(index, requests):
    held = []  # the engine's cache, oldest first
    def make(n):
        out = []
        for _ in range(n):
            chain = [rng.getrandbits(64) for _ in range(32)]
            out.append(KVEventBatch(0.0, [BlockStored(chain, None)]))
            held.extend(chain)
            last = chain[-1]
            for _ in range(4):
                h = rng.getrandbits(64)
                out.append(KVEventBatch(0.0, [BlockStored([h], last)]))
                held.append(h)
                last = h
            if len(held) > 28_000:
                gone = held[: len(held) - 28_000]
                del held[: len(gone)]
                out.append(KVEventBatch(0.0, [BlockRemoved(gone)]))
        return out
    return timed(index, make(2_000), make(requests))  # warm: the cache full

def flood(index, blocks):
    def make(n):
        return [KVEventBatch(0.0, [BlockStored([rng.getrandbits(64) for _ in range(32)], None)])
                for _ in range(n // 32)]
    return timed(index, make(100_000), make(blocks))

def route(index, n, filler):
    for _ in range(filler // 32):
        index.stored(E, [rng.getrandbits(64) for _ in range(32)], 1.0, head=True)
    prompts = []
    for _ in range(200):
        p = [rng.getrandbits(64) for _ in range(64)]
        index.stored(E, p[:48], 1.0, head=True)
        prompts.append(p)
    match = index.match
    t = time.process_time_ns()
    for i in range(n):
        match(prompts[i % 200])
    return (time.process_time_ns() - t) / n

print(json.dumps({
    "honest_ns_per_event": round(honest(ExactPrefixIndex(), 4_000)),
    "flood_ns_per_event": round(flood(ExactPrefixIndex(), 200_000)),
    "route_ns_per_lookup": round(route(ExactPrefixIndex(), 20_000, 0)),
    "route_full_ns_per_lookup": round(route(ExactPrefixIndex(), 20_000, 21_600)),
}))
"""


def run_variant(src: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": src}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True
    )
    result: dict[str, float] = json.loads(out.stdout)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the other tree's src directory")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    here = str(Path(__file__).resolve().parents[3])
    for k in range(args.rounds):
        if k % 2:  # alternate which goes first (A B, B A, ...)
            new, base = run_variant(here), run_variant(args.base)
        else:
            base, new = run_variant(args.base), run_variant(here)
        ratios = {key: round(new[key] / base[key], 3) for key in new}
        print(json.dumps({"round": k, "base": base, "this": new, "ratio": ratios}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
