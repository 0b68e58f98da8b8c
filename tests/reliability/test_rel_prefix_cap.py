"""Finding 7 (and G3's "no growth in per-request caches"): with unique prompts the prefix
index reaches its cap and holds it; entries and traced memory stop growing there."""

from __future__ import annotations

import random
import tracemalloc

from poolkeeper.scheduling.prefix import PrefixIndex, prefix_hashes

CAP = 2_000
ENDPOINTS = [f"10.0.0.{i}:8000" for i in range(4)]


def _fill(index: PrefixIndex, rng: random.Random, prompts: int) -> None:
    for i in range(prompts):
        prompt = rng.randbytes(640).hex()  # 1,280 characters: 20 unique 64-character blocks
        hashes = prefix_hashes("m", prompt, block_size=64, max_blocks=256)
        index.insert(ENDPOINTS[i % len(ENDPOINTS)], hashes)


def test_prefix_index_reaches_its_cap_and_holds_it() -> None:
    rng = random.Random(7)
    index = PrefixIndex(CAP)
    per_fill = CAP * len(ENDPOINTS) // 20  # prompts that fill every endpoint once
    _fill(index, rng, per_fill)
    assert index.size == CAP * len(ENDPOINTS)
    tracemalloc.start()
    try:
        _fill(index, rng, per_fill)  # turn the whole index over once (allocator warm)
        baseline, _ = tracemalloc.get_traced_memory()
        _fill(index, rng, 3 * per_fill)
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert index.size == CAP * len(ENDPOINTS)
    assert all(index.blocks(e) == CAP for e in ENDPOINTS)
    assert len(index._holders) <= CAP * len(ENDPOINTS)
    assert after - baseline < 0.05 * max(baseline, 1) + 64 * 1024, (baseline, after)
