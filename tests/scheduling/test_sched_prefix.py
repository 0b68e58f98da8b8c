"""Prefix hashing, the per-endpoint LRU index, and the prefix-cache scorer end to end."""

from __future__ import annotations

import xxhash
from hypothesis import given, settings, strategies as st

from poolkeeper.scheduling.interfaces import ProfileResult
from poolkeeper.scheduling.prefix import PrefixIndex, prefix_hashes
from tests.scheduling.sched_factories import (
    cycle,
    key,
    plugin,
    request,
    scheduler,
    scores_of,
    single,
    state,
)

A64, B64, C64 = "a" * 64, "b" * 64, "c" * 64


def test_hashes_are_chained_and_seeded_by_model() -> None:
    h = prefix_hashes("m", A64 + B64 + "tail", block_size=64, max_blocks=256)
    assert len(h) == 2  # the partial tail block is ignored
    seed = xxhash.xxh64_intdigest(b"m")
    first = xxhash.xxh64_intdigest(A64.encode(), seed)
    assert h == [first, xxhash.xxh64_intdigest(B64.encode(), first)]
    # Same block content after a different first block -> a different hash (chained).
    assert prefix_hashes("m", C64 + B64, block_size=64, max_blocks=256)[1] != h[1]
    # Another model (or LoRA adapter) never shares a hash.
    assert prefix_hashes("other", A64 + B64, block_size=64, max_blocks=256)[0] != h[0]


def test_hashes_short_prompt_and_block_limits() -> None:
    assert prefix_hashes("m", "x" * 63, block_size=64, max_blocks=256) == []
    assert len(prefix_hashes("m", "x" * 640, block_size=64, max_blocks=4)) == 4
    assert len(prefix_hashes("m", "x" * 640, block_size=16, max_blocks=256)) == 40


def test_hashes_use_characters_not_bytes() -> None:
    # 64 characters of a 3-byte UTF-8 character are one block.
    assert len(prefix_hashes("m", "€" * 64, block_size=64, max_blocks=256)) == 1


def test_match_counts_consecutive_leading_blocks() -> None:
    idx = PrefixIndex(100)
    idx.insert("e1", [1, 2, 3, 4])
    idx.insert("e2", [1, 2, 9])
    idx.insert("e3", [5, 6])
    assert idx.match([1, 2, 3, 4, 5]) == {"e1": 4, "e2": 2}
    assert idx.match([1, 2, 9, 4]) == {"e2": 3, "e1": 2}
    assert idx.match([2, 3]) == {"e1": 2, "e2": 1}
    assert idx.match([7, 1, 2]) == {}  # a miss on block 0 is a miss on all
    assert idx.match([]) == {}
    # e3 holds 6 but not its block 0 hash in this chain: no credit.
    assert idx.match([1, 6]) == {"e1": 1, "e2": 1}


def test_lru_evicts_tail_blocks_first_per_endpoint() -> None:
    idx = PrefixIndex(3)
    idx.insert("e1", [1, 2, 3])
    idx.insert("e1", [1, 7])  # head touched again, 7 new: evicts the oldest tail (3)
    assert idx.blocks("e1") == 3
    assert idx.holders(3) == frozenset()
    assert idx.match([1, 2, 3]) == {"e1": 2}
    assert idx.match([1, 7]) == {"e1": 2}
    idx.insert("e2", [1])
    assert idx.holders(1) == {"e1", "e2"}


def test_forget_endpoints_drops_their_blocks() -> None:
    idx = PrefixIndex(10)
    idx.insert("e1", [1, 2])
    idx.insert("e2", [1, 3])
    idx.forget_endpoints({"e2"})
    assert idx.endpoints() == ["e2"]
    assert idx.match([1, 2]) == {"e2": 1}
    assert idx.size == 2
    assert idx.holders(2) == frozenset()


def test_scorer_scores_matched_share_and_inserts_after_decision() -> None:
    scorer = plugin("prefix-cache-scorer")
    pool = [state(1), state(2), state(3)]
    req = request(prompt=A64 + B64 + C64 + B64)
    assert scores_of(scorer, req, pool) == [0.0, 0.0, 0.0]
    scorer.post_cycle(cycle(), req, ProfileResult("p", (pool[1], pool[0])))
    # Only the primary pick is recorded.
    assert scores_of(scorer, req, pool) == [0.0, 1.0, 0.0]
    half = request(prompt=A64 + B64 + "z" * 128)
    assert scores_of(scorer, half, pool) == [0.0, 0.5, 0.0]
    other_model = request("adapter-x", prompt=A64 + B64 + C64 + B64)
    assert scores_of(scorer, other_model, pool) == [0.0, 0.0, 0.0]
    assert scores_of(scorer, request(prompt="short"), pool) == [0.0, 0.0, 0.0]


def test_min_scored_blocks_caps_the_score_of_short_prompts() -> None:
    pool = [state(1), state(2)]
    floor = plugin("prefix-cache-scorer", {"minScoredBlocks": 8})
    upstream = plugin("prefix-cache-scorer")
    one_block = request(prompt=A64 + "tail")
    for scorer in (floor, upstream):
        scorer.post_cycle(cycle(), one_block, ProfileResult("p", (pool[0],)))
    # Upstream: a one-block hit scores like a 4k-token shared system prompt.
    assert scores_of(upstream, one_block, pool) == [1.0, 0.0]
    # With the floor, it earns only 1 of 8 blocks.
    assert scores_of(floor, one_block, pool) == [0.125, 0.0]
    long_prompt = request(prompt=A64 * 16)
    floor.post_cycle(cycle(), long_prompt, ProfileResult("p", (pool[1],)))
    # Prompts longer than the floor are scored as before: matched / prompt blocks.
    assert scores_of(floor, long_prompt, pool) == [0.0625, 1.0]


def test_default_profile_spreads_identical_short_prompts() -> None:
    sched = scheduler("default")
    picks: list[str] = []
    for n in range(30):
        # Each pick becomes visible as one more queued request on that endpoint.
        loaded = [state(i, waiting=sum(p == key(i) for p in picks)) for i in range(1, 4)]
        got = sched.schedule(
            request(prompt="Write one line about X." * 4, request_id=f"r{n}"), loaded, now=100.0
        )
        picks.append(got.primary.key)
    assert len(set(picks)) == 3
    assert max(picks.count(k) for k in set(picks)) <= 15


def test_scorer_hashes_once_per_cycle() -> None:
    scorer = plugin("prefix-cache-scorer")
    c = cycle()
    req = request(prompt=A64 * 3)
    first = scorer.hashes(c, req)
    assert scorer.hashes(c, req) is first


def test_scheduler_sticks_to_the_endpoint_holding_the_prefix() -> None:
    sched = scheduler(single({"type": "prefix-cache-scorer"}))
    pool = [state(i) for i in range(1, 9)]
    system = "s" * 1024
    first = sched.schedule(request(prompt=system + "q1" * 40), pool, now=100.0).primary.key
    for n in range(2, 20):
        got = sched.schedule(request(prompt=system + f"q{n}" * 40), pool, now=100.0)
        assert got.primary.key == first
    scorer = sched.plugins["prefix-cache-scorer"]
    assert scorer.index.endpoints() == [first]  # type: ignore[attr-defined, unused-ignore]
    sched.forget_endpoints({key(i) for i in range(1, 9)} - {first})
    assert scorer.index.endpoints() == []  # type: ignore[attr-defined, unused-ignore]
    # Cold prompts (no hit anywhere) spread by the random tie-break, not onto one endpoint.
    cold = {
        sched.schedule(
            request(prompt=f"{n:04d}" * 64, request_id=f"c{n}"), pool, now=100.0
        ).primary.key
        for n in range(40)
    }
    assert len(cold) >= 5


def test_cold_affinity_sends_a_new_prefix_to_one_endpoint_from_every_replica() -> None:
    pool = [state(i) for i in range(1, 9)]
    params = {"minScoredBlocks": 8, "coldAffinity": 0.2, "coldAffinityBlocks": 8}
    replicas = [plugin("prefix-cache-scorer", params) for _ in range(4)]
    system = "s" * 1024  # 16 blocks: long enough to count
    # Four replicas that have never seen the prefix score the same endpoint, whatever the
    # question after it and whatever order they list the endpoints in.
    picks = set()
    for n, scorer in enumerate(replicas):
        order = pool[n:] + pool[:n]
        got = scores_of(scorer, request(prompt=system + f"question {n}"), order)
        assert sorted(got) == [0.0] * 7 + [0.2]
        picks.add(order[got.index(0.2)].key)
    assert len(picks) == 1
    # Different prefixes spread over the endpoints (a hash ring, not one favourite).
    lone = replicas[0]
    winners = set()
    for n in range(40):
        got = scores_of(lone, request(prompt=f"{n:04d}" * 160), pool)
        winners.add(pool[got.index(0.2)].key)
    assert len(winners) >= 6
    (winner,) = picks
    # Removing an endpoint moves only the prefixes it won.
    rest = [s for s in pool if s.key != winner]
    other = request(prompt=system + "again")
    survivor = scores_of(lone, other, rest)
    assert sorted(survivor) == [0.0] * 6 + [0.2]


def test_cold_affinity_gives_way_to_a_known_holder_and_ignores_short_prompts() -> None:
    pool = [state(1), state(2), state(3)]
    scorer = plugin(
        "prefix-cache-scorer", {"minScoredBlocks": 8, "coldAffinity": 0.2, "coldAffinityBlocks": 8}
    )
    system = "s" * 1024
    # Once a replica knows where the prefix is, the matched share is the score, as without.
    scorer.post_cycle(cycle(), request(prompt=system), ProfileResult("p", (pool[2],)))
    assert scores_of(scorer, request(prompt=system + "x" * 64), pool) == [0.0, 0.0, 16 / 17]
    # A prompt shorter than coldAffinityBlocks blocks earns nothing: too short to be worth a
    # prefill saved, and identical short prompts must not herd.
    assert scores_of(scorer, request(prompt="t" * 448), pool) == [0.0] * 3
    # The key is 32 blocks (512 tokens) unless set: a 16-block prompt gets none.
    assert (
        scores_of(
            plugin("prefix-cache-scorer", {"coldAffinity": 0.2}), request(prompt=system), pool
        )
        == [0.0] * 3
    )
    # Off (the plugin's default): a cold prompt scores 0 everywhere.
    off = plugin("prefix-cache-scorer", {"minScoredBlocks": 8})
    assert scores_of(off, request(prompt=system), pool) == [0.0] * 3


def test_cold_spread_sends_a_new_prefix_where_the_index_holds_least() -> None:
    pool = [state(1), state(2), state(3)]
    params = {"coldSpread": 0.5, "coldAffinityBlocks": 8}
    scorer = plugin("prefix-cache-scorer", params)
    fresh = request(prompt="n" * 1024)  # 16 blocks, held nowhere
    # Nothing indexed anywhere yet: no signal.
    assert scores_of(scorer, fresh, pool) == [0.0] * 3
    scorer.post_cycle(cycle(), request(prompt="a" * 1024), ProfileResult("p", (pool[0],)))
    scorer.post_cycle(cycle(), request(prompt="b" * 512), ProfileResult("p", (pool[1],)))
    # 16 and 8 blocks indexed on the first two, none on the third.
    assert scores_of(scorer, fresh, pool) == [0.0, 0.25, 0.5]
    # A prompt some endpoint holds is scored by its match, as without.
    assert scores_of(scorer, request(prompt="a" * 1024 + "x" * 64), pool) == [16 / 17, 0.0, 0.0]
    # Short prompts (under coldAffinityBlocks) get nothing.
    assert scores_of(scorer, request(prompt="t" * 448), pool) == [0.0] * 3
    # With cold affinity too, the ring's owner gets both (capped at 1).
    both = plugin("prefix-cache-scorer", {**params, "coldAffinity": 0.6})
    both.post_cycle(cycle(), request(prompt="a" * 1024), ProfileResult("p", (pool[0],)))
    got = scores_of(both, fresh, pool)
    assert sorted(got) in ([0.5, 0.5, 0.6], [0.0, 0.5, 1.0])  # the owner holds the prefix or not


INDEX_OPS = st.lists(
    st.tuples(
        st.sampled_from(["insert", "insert", "forget"]),
        st.sampled_from(["e1", "e2", "e3"]),
        st.lists(st.integers(0, 9), min_size=1, max_size=6),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(ops=INDEX_OPS, capacity=st.integers(1, 6), probe=st.lists(st.integers(0, 9), max_size=6))
def test_index_matches_a_naive_model(
    ops: list[tuple[str, str, list[int]]], capacity: int, probe: list[int]
) -> None:
    """The index (single holders stored as strings, sets otherwise) behaves like per-endpoint
    LRU lists with tail-first insertion and consecutive-prefix matching."""
    idx = PrefixIndex(capacity)
    naive: dict[str, list[int]] = {}  # most recent last
    for op, endpoint, hashes in ops:
        if op == "insert":
            lru = naive.setdefault(endpoint, [])
            for h in reversed(hashes):
                if h in lru:
                    lru.remove(h)
                lru.append(h)
            del lru[: max(0, len(lru) - capacity)]
            idx.insert(endpoint, hashes)
        else:
            naive.pop(endpoint, None)
            idx.forget_endpoints(set(naive))
    want: dict[str, int] = {}
    for endpoint, lru in naive.items():
        depth = 0
        for h in probe:
            if h not in lru:
                break
            depth += 1
        if depth:
            want[endpoint] = depth
    assert idx.match(probe) == want
    assert idx.size == sum(len(lru) for lru in naive.values())
    for h in range(10):
        assert idx.holders(h) == {e for e, lru in naive.items() if h in lru}
