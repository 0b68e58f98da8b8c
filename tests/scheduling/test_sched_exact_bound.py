"""The exact prefix index's per-endpoint bound (`max_blocks_per_endpoint`,
`kvIndexMaxBlocksPerEndpoint`): what it keeps, what it drops, and what a publisher cannot do."""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

from poolkeeper.kvevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    engine_block_hashes,
)
from poolkeeper.scheduling.exact_prefix import MAX_BLOCKS_PER_ENDPOINT, ExactPrefixIndex
from poolkeeper.scheduling.interfaces import CycleState
from poolkeeper.scheduling.plugins.prefix_params import PrefixCacheParams
from tests.scheduling.sched_factories import NOW, key, plugin, request, state


def _batch(*events: BlockStored | BlockRemoved | AllBlocksCleared) -> KVEventBatch:
    return KVEventBatch(0.0, list(events))


def test_a_flood_of_stores_without_removes_stays_within_the_bound() -> None:
    index = ExactPrefixIndex(max_blocks_per_endpoint=100)
    index.stored("honest", [1, 2, 3], 0.0, head=True)
    rng = random.Random(7)
    for t in range(2_000):  # a hostile publisher: new chains, 5 blocks each, never removed
        chain = [rng.getrandbits(64) for _ in range(5)]
        index.apply("hostile", _batch(BlockStored(chain, None)), now=float(t))
    assert index.blocks("hostile") == 100
    assert index.evictions == 2_000 * 5 - 100
    # Heads it reported and the bound dropped are no longer counted as held.
    assert index.heads("hostile", 2_000.0, pending=False) == 20
    # Continuations of blocks it does not hold here are never stored at all.
    for t in range(1_000):
        parent = rng.getrandbits(64)
        index.apply("hostile", _batch(BlockStored([t, t + 1], parent)), now=3_000.0)
    assert index.blocks("hostile") == 100
    assert index.unanchored == 2_000
    # Another endpoint's view is untouched.
    assert index.blocks("honest") == 3
    assert index.match([1, 2, 3]) == {"honest": 3}
    assert index.size == 103


def test_the_least_recently_stored_chain_goes_first_and_its_tail_before_its_head() -> None:
    index = ExactPrefixIndex(max_blocks_per_endpoint=6)
    index.stored("e", [1, 2, 3], 0.0, head=True)
    index.stored("e", [4, 5, 6], 1.0, head=True)
    assert index.evictions == 0
    index.stored("e", [7], 2.0, head=True)  # one over: the oldest chain's last block goes
    index.stored("e", [8, 9], 3.0, head=True)  # then the rest of that chain, head last
    assert index.evictions == 3
    assert index.match([1, 2, 3]) == {}
    assert index.match([4, 5, 6]) == {"e": 3}
    assert index.heads("e", 3.0, pending=False) == 3  # chains 4, 7 and 8
    # A continuation of the evicted chain cannot be matched and is not stored.
    index.apply("e", _batch(BlockStored([10], 3)), now=4.0)
    assert index.unanchored == 1
    assert index.blocks("e") == 6


def test_one_over_the_bound_drops_a_chain_tail_not_its_head() -> None:
    index = ExactPrefixIndex(max_blocks_per_endpoint=6)
    index.stored("e", [1, 2, 3], 0.0, head=True)
    index.stored("e", [4, 5, 6], 1.0, head=True)
    index.stored("e", [7], 2.0, head=True)
    assert index.match([1, 2, 3]) == {"e": 2}
    assert index.match([4, 5, 6]) == {"e": 3}


def test_order_is_store_order_a_lookup_keeps_nothing_a_new_store_does() -> None:
    index = ExactPrefixIndex(max_blocks_per_endpoint=6)
    index.stored("e", [1, 2, 3], 0.0, head=True)
    index.stored("e", [4, 5, 6], 1.0, head=True)
    assert index.match([1, 2, 3]) == {"e": 3}  # asked for: not refreshed
    index.stored("e", [4, 5], 2.0, head=True)  # reported again (re-stored): refreshed
    index.stored("e", [7, 8], 3.0, head=True)
    assert index.match([1, 2, 3]) == {"e": 1}
    assert index.match([4, 5, 6]) == {"e": 3}
    assert index.match([7, 8]) == {"e": 2}


def test_removes_of_evicted_blocks_are_harmless_and_shared_blocks_stay_with_others() -> None:
    index = ExactPrefixIndex(max_blocks_per_endpoint=3)
    index.stored("e1", [1, 2, 3], 0.0, head=True)
    index.stored("e2", [1, 2, 3], 0.0, head=True)
    index.stored("e1", [4, 5, 6], 1.0, head=True)  # e1 drops 1, 2, 3; e2 still holds them
    assert index.match([1, 2, 3]) == {"e2": 3}
    assert index.match([4, 5, 6]) == {"e1": 3}
    index.apply("e1", _batch(BlockRemoved([1, 2, 3])), now=2.0)  # the engine evicts them too
    assert index.match([1, 2, 3]) == {"e2": 3}
    assert index.match([4, 5, 6]) == {"e1": 3}
    assert index.size == 6
    assert index.evictions == 3


def test_clears_and_lost_feeds_reset_an_endpoint_as_before() -> None:
    index = ExactPrefixIndex(max_blocks_per_endpoint=4, stale_after_s=5.0)
    for t in range(10):
        index.stored("e", [10 * t, 10 * t + 1], float(t), head=True)
    assert index.blocks("e") == 4
    index.apply("e", _batch(AllBlocksCleared()), now=10.0)
    assert index.blocks("e") == 0
    assert index.heads("e", 10.0, pending=False) == 0
    index.stored("e", [1, 2, 3, 4], 11.0, head=True)
    assert index.match([1, 2, 3, 4]) == {"e": 4}
    evictions = index.evictions
    index.lost("e", 12.0)
    assert index.size == 0
    assert index.evictions == evictions
    assert not index.fresh("e", 16.9)
    assert index.fresh("e", 17.0)


def test_kept_blocks_match_exactly_as_without_the_bound() -> None:
    """A random event stream on several endpoints: the bounded index never claims more than
    the unbounded one, never holds more than its bound, and where the bound is never reached
    it answers every query the same."""
    rng = random.Random(3)
    tight = ExactPrefixIndex(max_blocks_per_endpoint=40)
    ample = ExactPrefixIndex(max_blocks_per_endpoint=10_000)
    unbounded = ExactPrefixIndex(max_blocks_per_endpoint=1 << 40)
    chains = [[rng.getrandbits(64) for _ in range(rng.randint(1, 12))] for _ in range(60)]
    endpoints = ["e1", "e2", "e3"]
    for step in range(3_000):
        endpoint = rng.choice(endpoints)
        chain = rng.choice(chains)
        roll = rng.random()
        if roll < 0.5:
            cut = rng.randint(0, len(chain) - 1)
            parent = chain[cut - 1] if cut else None
            event: BlockStored | BlockRemoved = BlockStored(chain[cut:], parent)
        else:
            event = BlockRemoved(chain[rng.randint(0, len(chain) - 1) :])
        for index in (tight, ample, unbounded):
            index.apply(endpoint, _batch(event), now=float(step))
        query = rng.choice(chains)
        full = unbounded.match(query)
        assert ample.match(query) == full
        assert all(depth <= full.get(e, 0) for e, depth in tight.match(query).items())
        assert all(tight.blocks(e) <= 40 for e in endpoints)
    assert tight.evictions > 0
    assert ample.evictions == 0


def test_the_scorer_passes_its_bound_and_its_lookups_keep_asked_for_prefixes() -> None:
    assert PrefixCacheParams().kv_index_max_blocks_per_endpoint == MAX_BLOCKS_PER_ENDPOINT
    with pytest.raises(
        ValidationError, match=r"kvIndexMaxBlocksPerEndpoint\n.*greater than or equal to 1"
    ):
        PrefixCacheParams.model_validate({"kvIndexMaxBlocksPerEndpoint": 0})
    scorer = plugin(
        "prefix-cache-scorer",
        {"kvEvents": True, "kvEventsSubscribe": False, "kvIndexMaxBlocksPerEndpoint": 4},
    )
    exact = scorer.exact
    assert exact is not None
    assert exact.max_blocks_per_endpoint == 4
    a, b = "a" * 64 + "b" * 64, "c" * 64 + "d" * 64
    ha, hb = engine_block_hashes("base", a, 16), engine_block_hashes("base", b, 16)
    exact.stored(key(2), ha, NOW, head=True)
    pool = [state(1), state(2)]

    def scores() -> list[float]:
        out = scorer.score(CycleState(NOW), request(prompt=a), pool)
        return [float(out)] * 2 if isinstance(out, float) else list(out)

    assert scores() == [0.0, 1.0]
    exact.stored(key(2), [*hb, 1, 2], NOW, head=True)  # endpoint 2's engine moved on: `a` out
    assert exact.blocks(key(2)) == 4
    assert scores() == [0.0, 0.0]
