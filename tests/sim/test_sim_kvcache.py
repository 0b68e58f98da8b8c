"""Block accounting and prefix hashing of the simulated KV cache."""

from __future__ import annotations

import pytest

from poolkeeper.sim.kvcache import PrefixKVCache, prompt_block_hashes


def test_hashes_are_chained_per_full_block_and_per_model() -> None:
    text = "a" * 64 + "b" * 64 + "c" * 10
    hashes = prompt_block_hashes(text, 16, "m")
    assert len(hashes) == 2  # the partial third block is not hashed
    assert prompt_block_hashes("a" * 64 + "b" * 64, 16, "m") == hashes
    # Same second chunk after a different first chunk: a different chained hash.
    assert prompt_block_hashes("z" * 64 + "b" * 64, 16, "m")[1] != hashes[1]
    assert prompt_block_hashes(text, 16, "adapter")[0] != hashes[0]
    assert prompt_block_hashes("é" * 64, 16, "m") == prompt_block_hashes("é" * 64 + "x", 16, "m")


def test_shared_blocks_count_once_and_freed_blocks_stay_cached() -> None:
    cache = PrefixKVCache(10)
    cache.take_hashed(1)
    cache.take_hashed(1)  # a second user shares it
    cache.take_private(2)
    assert cache.referenced == 3
    assert cache.usage == pytest.approx(0.3)
    cache.release([1], 2)
    assert cache.referenced == 1
    cache.release([1], 0)
    assert cache.referenced == 0
    assert cache.cached_prefix([1, 2]) == 1  # still cached, now evictable


def test_eviction_is_least_recently_freed_tail_first() -> None:
    cache = PrefixKVCache(4)
    for h in (1, 2, 3):
        cache.take_hashed(h)
    cache.release([1, 2, 3], 0)  # frees 3, then 2, then 1: block 3 is the oldest
    cache.take_private(2)  # 1 empty block + evict one
    assert cache.cached_prefix([1, 2]) == 2
    assert cache.cached_prefix([3]) == 0
    assert cache.can_allocate([1, 2], 0)  # evictable blocks can be taken back
    assert not cache.can_allocate([9, 8, 7], 0)


def test_over_allocation_is_an_error() -> None:
    cache = PrefixKVCache(2)
    cache.take_private(2)
    with pytest.raises(RuntimeError):
        cache.take_private(1)


def test_linear_histogram_observation_matches_one_by_one() -> None:
    from poolkeeper.sim.stats import ITL_BUCKETS, Histogram

    for first, step, count in ((0.006, 0.0004, 300), (0.02, 0.0, 10), (0.009, 0.001, 1)):
        bulk, single = Histogram(ITL_BUCKETS), Histogram(ITL_BUCKETS)
        bulk.observe_linear(first, step, count, 3)
        for j in range(count):
            single.observe_many(first + step * j, 3)
        assert bulk.counts == single.counts
        assert bulk.count == single.count
        assert bulk.sum == pytest.approx(single.sum)
