"""How much the prefix index alone moves glibc's main arena once it is full (docs/reliability.md,
Soak): the soak's traffic (unique prompts of 4-64 random words over two endpoints, the default
31,250 blocks each), in this process, no gateway. The index's dictionaries are resized as
entries are evicted and inserted, so the arena moves in steps of several MB that a short
window reads as a slope; over many requests it is flat.

    .venv/bin/python scripts/prefix_index_arena.py [--requests 200000] [--window 50000]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.reliability.memprobe import main_arena_mb

from poolkeeper.scheduling.prefix import PrefixIndex, prefix_hashes

STEP = 5_000


def _slope(ys: list[float]) -> float:
    n = len(ys)
    mx, my = (n - 1) / 2, sum(ys) / n
    return sum((x - mx) * (y - my) for x, y in enumerate(ys)) / sum((x - mx) ** 2 for x in range(n))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200_000, help="measured, after filling")
    parser.add_argument("--window", type=int, default=50_000, help="requests per fitted window")
    args = parser.parse_args()
    index = PrefixIndex(31_250)
    rng = random.Random(1)
    endpoints = ["127.0.0.1:8001", "127.0.0.1:8002"]

    def requests(n: int) -> None:
        for _ in range(n):
            prompt = f"{rng.getrandbits(64):x} " * rng.randint(4, 64)
            hashes = prefix_hashes("m", prompt, block_size=64, max_blocks=128)
            index.match(hashes)
            index.insert(rng.choice(endpoints), hashes)

    requests(100_000)  # full: every endpoint's LRU at its capacity
    points = []
    for _ in range(args.requests // STEP):
        requests(STEP)
        points.append(main_arena_mb(os.getpid()))
    print("arena (MB, every 5,000 requests):", " ".join(f"{p - points[0]:+.1f}" for p in points))
    width = max(3, args.window // STEP)
    per_window = [
        _slope(points[i : i + width]) * (1 << 20) / STEP for i in range(len(points) - width + 1)
    ]
    print(
        f"slope over {args.window:,}-request windows: {min(per_window):+.0f} to "
        f"{max(per_window):+.0f} bytes per request; over all {args.requests:,}: "
        f"{_slope(points) * (1 << 20) / STEP:+.1f}"
    )


if __name__ == "__main__":
    main()
