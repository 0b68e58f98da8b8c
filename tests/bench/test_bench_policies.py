"""Baseline policies: each published rule on hand-made endpoint states."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from poolkeeper.bench.policies.baselines import (
    AIBrixPrefix,
    CacheAware,
    CacheAwareParams,
    DynamoKV,
    LeastRequest,
    PowerOfTwo,
    RandomPick,
    RoundRobin,
)
from poolkeeper.bench.policies.prefixtrees import (
    ApproxRadixTree,
    BlockPrefixIndex,
    common_prefix_len,
)
from poolkeeper.datastore.endpoint import Endpoint, EndpointMetrics, EndpointState
from poolkeeper.errors import NoReadyEndpoint
from poolkeeper.scheduling.types import LLMRequest
from poolkeeper.tokens import count_tokens


def _eps(*loads: int, tokens: tuple[int, ...] | None = None) -> list[EndpointState]:
    toks = tokens or tuple(0 for _ in loads)
    return [
        EndpointState(
            Endpoint(f"s{i}", "10.0.0.1", 8000 + i),
            EndpointMetrics(),
            inflight_requests=n,
            inflight_tokens=t,
        )
        for i, (n, t) in enumerate(zip(loads, toks, strict=True))
    ]


def _req(prompt: str, rid: str = "r") -> LLMRequest:
    return LLMRequest(rid, "m", "m", prompt=prompt, prompt_tokens=count_tokens(prompt))


SYSTEM = "You are a helpful assistant. " * 20  # 580 characters


def test_round_robin_cycles_in_order() -> None:
    rr = RoundRobin(random.Random(0))
    eps = _eps(0, 0, 0)
    assert [rr.pick(_req("x"), eps, 0.0).endpoint.name for _ in range(5)] == [
        "s0", "s1", "s2", "s0", "s1",
    ]  # fmt: skip


def test_random_uses_every_endpoint_and_least_request_the_minimum() -> None:
    eps = _eps(3, 1, 1, 5)
    rnd = RandomPick(random.Random(1))
    assert {rnd.pick(_req("x"), eps, 0).endpoint.name for _ in range(200)} == {
        "s0",
        "s1",
        "s2",
        "s3",
    }
    lr = LeastRequest(random.Random(1))
    picks = Counter(lr.pick(_req("x"), eps, 0).endpoint.name for _ in range(200))
    assert set(picks) == {"s1", "s2"}  # random among the tied minimum


def test_power_of_two_never_picks_the_most_loaded_of_three() -> None:
    p2 = PowerOfTwo(random.Random(2))
    eps = _eps(1, 2, 9)
    picks = Counter(p2.pick(_req("x"), eps, 0).endpoint.name for _ in range(300))
    assert "s2" not in picks
    assert picks["s0"] > picks["s1"] > 0  # s0 wins both of its pairs


def test_no_endpoint_raises() -> None:
    with pytest.raises(NoReadyEndpoint):
        RoundRobin(random.Random(0)).pick(_req("x"), [], 0.0)


def test_cache_aware_follows_prefix_when_balanced() -> None:
    ca = CacheAware(random.Random(0))
    eps = _eps(0, 0, 0)
    first = ca.pick(_req(SYSTEM + "question one"), eps, 0.0)
    assert first.endpoint.name == "s0"  # a miss goes to the first least-loaded worker
    # s1 is now least loaded, but the shared prefix (>30% of the prompt) wins.
    eps = _eps(5, 0, 0)
    again = ca.pick(_req(SYSTEM + "question two"), eps, 1.0)
    assert again.endpoint.name == "s0"
    # A short shared part (below the 0.3 cache threshold) falls back to least load.
    other = ca.pick(_req(SYSTEM[:40] + "x" * 400), eps, 2.0)
    assert other.endpoint.name == "s1"


def test_cache_aware_switches_to_least_load_when_imbalanced() -> None:
    ca = CacheAware(random.Random(0))
    ca.pick(_req(SYSTEM + "q1"), _eps(0, 0), 0.0)  # s0 learns the prefix
    # max - min = 70 > 64 and 70 > 1.5 * 0: imbalanced -> least loaded, despite the prefix.
    assert ca.pick(_req(SYSTEM + "q2"), _eps(70, 0), 1.0).endpoint.name == "s1"
    # max - min = 60 <= 64: balanced -> prefix wins again (s0 and s1 both hold it now;
    # s1 most recently).
    assert ca.pick(_req(SYSTEM + "q3"), _eps(60, 0), 2.0).endpoint.name == "s1"
    assert ca.pick(_req(SYSTEM + "q4"), _eps(0, 60), 3.0).endpoint.name == "s1"
    # gap 70 > 64 and 130 > 1.5 x 60: imbalanced either way round.
    assert ca.pick(_req(SYSTEM + "q5"), _eps(130, 60), 4.0).endpoint.name == "s1"
    assert ca.pick(_req(SYSTEM + "q6"), _eps(60, 130), 5.0).endpoint.name == "s0"


def test_cache_aware_rel_threshold_keeps_prefix_when_ratio_is_small() -> None:
    ca = CacheAware(random.Random(0), CacheAwareParams(balance_abs_threshold=64))
    ca.pick(_req(SYSTEM + "q1"), _eps(0, 0), 0.0)
    # gap 80 > 64 but 280 <= 1.5 * 200: balanced, so the prefix holder s0 keeps it.
    assert ca.pick(_req(SYSTEM + "q2"), _eps(280, 200), 1.0).endpoint.name == "s0"


def test_radix_tree_match_split_and_eviction() -> None:
    assert common_prefix_len("abcdef", "abcxyz") == 3
    assert common_prefix_len("abc", "abc") == 3
    tree = ApproxRadixTree(max_chars_per_worker=12)
    tree.insert("hello world", "a", 1.0)
    tree.insert("hello there", "b", 2.0)
    m = tree.match("hello wonder")
    assert m.matched_chars == 8
    assert set(m.tenants) == {"a"}
    m = tree.match("hello zzz")
    assert m.matched_chars == 6
    assert set(m.tenants) == {"a", "b"}
    tree.insert("xylophone!!", "a", 3.0)  # a now holds 22 characters (> 12)
    tree.evict()
    assert tree.chars("a") <= 12
    assert tree.match("xylophone!!").matched_chars == 11  # newest kept
    assert "a" not in tree.match("hello world").tenants  # oldest leaf evicted
    assert tree.match("hello there").matched_chars == 11  # b untouched


def test_block_index_counts_leading_blocks_and_lru() -> None:
    idx = BlockPrefixIndex(block_chars=4, capacity_per_worker=3)
    h = idx.hashes("m", "aaaabbbbccccdd")
    assert len(h) == 3  # partial block dropped
    assert idx.hashes("other", "aaaa") != idx.hashes("m", "aaaa")  # model seeds the chain
    idx.insert("w1", h[:2], 0.0)
    idx.insert("w2", h, 0.0)
    assert idx.match(h, 0.0) == {"w1": 2, "w2": 3}
    idx.insert("w1", idx.hashes("m", "zzzzyyyy"), 1.0)  # capacity 3 evicts w1's oldest block
    assert idx.match(h, 1.0) == {"w2": 3}
    ttl = BlockPrefixIndex(block_chars=4, capacity_per_worker=10, ttl=5.0)
    ttl.insert("w", h, 0.0)
    assert ttl.match(h, 4.0) == {"w": 3}
    assert ttl.match(h, 6.0) == {}


def test_dynamo_cost_trades_cached_prefill_against_decode_load() -> None:
    dyn = DynamoKV(random.Random(0))
    prompt = "p" * 64 * 40  # 40 blocks of 16 tokens
    dyn.pick(_req(prompt + "a"), _eps(0, 0, tokens=(0, 0)), 0.0)
    owner = next(iter(dyn.index.match(dyn.index.hashes("m", prompt), 0.0)))
    # The owner has 40 cached blocks; its decode load of 30 blocks (480 tokens) still wins.
    tokens = (480, 0) if owner == "10.0.0.1:8000" else (0, 480)
    chosen = dyn.pick(_req(prompt + "b"), _eps(1, 1, tokens=tokens), 1.0)
    assert chosen.key == owner
    # With 50 blocks of decode (800 tokens) the idle worker's 40-block prefill is cheaper.
    tokens = (800 * 2, 0) if owner == "10.0.0.1:8000" else (0, 800 * 2)
    assert dyn.pick(_req(prompt + "c"), _eps(1, 1, tokens=tokens), 2.0).key != owner
    e = _eps(0, tokens=(160,))[0]
    assert dyn.cost(_req(prompt), e, cached_blocks=10) == pytest.approx(
        count_tokens(prompt) / 16 - 10 + 10
    )


def test_aibrix_prefers_prefix_unless_spread_exceeds_16() -> None:
    ab = AIBrixPrefix(random.Random(0))
    text = SYSTEM * 2
    first = ab.pick(_req(text + "a"), _eps(0, 0, 0, 0), 0.0)
    owner = first.key
    loads = [3, 3, 3, 3]
    loads[int(owner[-1])] = 5  # owner a bit busier, within mean + 2 sigma
    assert ab.pick(_req(text + "b"), _eps(*loads), 1.0).key == owner
    loads = [0, 0, 0, 0]
    loads[int(owner[-1])] = 17  # spread > 16: least request
    chosen = ab.pick(_req(text + "c"), _eps(*loads), 2.0)
    assert chosen.key != owner
    assert chosen.inflight_requests == 0
