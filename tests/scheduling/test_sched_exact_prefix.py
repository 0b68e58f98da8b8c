"""KV events (vLLM's wire format), the exact prefix index and its staleness rule, and the
prefix scorer's exact mode preferring engine-reported blocks over its own guesses."""

from __future__ import annotations

import random

import msgpack
import pytest

from poolkeeper.kvevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventError,
    decode,
    encode,
    engine_block_hashes,
)
from poolkeeper.scheduling.exact_prefix import ExactPrefixIndex
from poolkeeper.scheduling.interfaces import CycleState, ProfileResult
from poolkeeper.sim.kvcache import PrefixKVCache
from tests.scheduling.sched_factories import NOW, key, plugin, request, state

A, B, C = "a" * 64, "b" * 64, "c" * 64  # one 16-token engine block each


def test_batch_round_trips_in_vllm_array_form() -> None:
    batch = KVEventBatch(
        12.5,
        [
            BlockStored([1, 2], None, [7] * 32, 16, None, "GPU"),
            BlockRemoved([1], "GPU"),
            AllBlocksCleared(),
        ],
        0,
    )
    payload = encode(batch)
    # The wire form is vLLM's: [ts, [[tag, fields...], ...], rank].
    raw = msgpack.unpackb(payload)
    assert raw[0] == 12.5
    assert raw[2] == 0
    assert raw[1][0] == ["BlockStored", [1, 2], None, [7] * 32, 16, None, "GPU"]
    assert raw[1][1] == ["BlockRemoved", [1], "GPU"]
    assert raw[1][2] == ["AllBlocksCleared"]
    # Decoding keeps everything but the token ids (the index does not need them).
    batch.events[0].token_ids = []  # type: ignore[union-attr]
    assert decode(payload) == batch


def test_decode_reads_the_map_form_bytes_hashes_and_skips_unknown_tags() -> None:
    payload = msgpack.packb(
        {
            "ts": 1,
            "events": [
                {"type": "BlockStored", "block_hashes": [b"\x00" * 7 + b"\x05"],
                 "parent_block_hash": None, "token_ids": [], "block_size": 32,
                 "lora_id": None, "medium": "GPU", "lora_name": None},
                {"type": "SomethingNew"},
                ["BlockRemoved", [9], None, 0],  # a trailing field from a newer engine
            ],
        }
    )  # fmt: skip
    got = decode(payload)
    assert got.ts == 1.0
    assert got.data_parallel_rank is None
    assert got.events == [
        BlockStored([5], None, block_size=32, medium="GPU"),
        BlockRemoved([9], None),
    ]


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"\xc1", "not msgpack"),
        (msgpack.packb("x"), "a batch must be"),
        (msgpack.packb([1.0, "no"]), "numeric ts and a list"),
        (msgpack.packb([1.0, [["BlockStored", [1]]]]), "BlockStored needs"),
        (msgpack.packb([1.0, [["BlockRemoved", [1.5]]]]), "integer or bytes"),
        (msgpack.packb([1.0, [7]]), "non-empty array or a map"),
    ],
)
def test_malformed_batches_get_a_precise_error(payload: bytes, message: str) -> None:
    with pytest.raises(KVEventError, match=message):
        decode(payload)


def test_engine_hashes_are_the_simulators_contract() -> None:
    from poolkeeper.sim.kvcache import prompt_block_hashes

    text = A + B + "tail"
    assert engine_block_hashes("m", text, 16) == prompt_block_hashes(text, 16, "m")
    assert len(engine_block_hashes("m", text, 16)) == 2


def test_the_simulated_cache_reports_stores_with_parents_and_evictions() -> None:
    class Sink:
        def __init__(self) -> None:
            self.events: list[tuple[str, list[int], int | None]] = []

        def stored(self, hashes: list[int], parent: int | None) -> None:
            self.events.append(("stored", hashes, parent))

        def removed(self, hashes: list[int]) -> None:
            self.events.append(("removed", hashes, None))

    kv = PrefixKVCache(2)
    sink = kv.sink = Sink()
    kv.take_hashed(10, None)
    kv.take_hashed(11, 10)
    kv.take_hashed(10, None)  # shared: no new event
    kv.release([10, 11], 0)
    kv.release([10], 0)
    kv.take_private(1)  # reuses the least recently freed cached block
    assert sink.events == [("stored", [10], None), ("stored", [11], 10), ("removed", [11], None)]


def test_exact_index_follows_stores_removals_and_clears() -> None:
    index = ExactPrefixIndex()
    index.apply("e1", KVEventBatch(0.0, [BlockStored([1, 2, 3], None)]), now=1.0)
    index.apply("e2", KVEventBatch(0.0, [BlockStored([1], None)]), now=1.0)
    assert index.match([1, 2, 3, 4]) == {"e1": 3, "e2": 1}
    index.apply("e1", KVEventBatch(0.0, [BlockRemoved([2])]), now=2.0)
    assert index.match([1, 2, 3]) == {"e1": 1, "e2": 1}
    index.apply("e2", KVEventBatch(0.0, [AllBlocksCleared()]), now=2.0)
    assert index.match([1]) == {"e1": 1}
    assert index.size == 2
    index.forget_endpoints({"e2"})
    assert index.size == 0
    assert not index.fresh("e1", 2.0)


def test_staleness_rule() -> None:
    index = ExactPrefixIndex(stale_after_s=5.0)
    assert not index.fresh("e", 0.0)  # never heard from
    assert index.staleness("e", 0.0) == "no_events"
    index.heard("e", 0.0)
    assert index.fresh("e", 100.0)  # idle and silent is fine
    index.routed("e", 100.0)
    index.routed("e", 103.0)  # the oldest unanswered routing counts
    assert index.fresh("e", 104.9)
    assert not index.fresh("e", 105.0)  # routed 5 s ago, nothing heard since
    assert index.staleness("e", 105.0) == "silent"
    index.heard("e", 106.0)
    assert index.fresh("e", 106.0)
    index.stored("e", [1], 107.0)
    index.lost("e", 107.0)  # sequence gap: its blocks are dropped and distrusted a while
    assert index.match([1]) == {}
    assert not index.fresh("e", 111.0)
    assert index.staleness("e", 111.0) == "lost"
    assert index.fresh("e", 112.0)
    assert index.staleness("e", 112.0) is None


def test_lookups_count_every_ask_and_the_best_endpoints_blocks() -> None:
    """Upstream's `lookup_hits` / `max_pod_hit_count`: the best pod's match, not the sum; a
    miss is still a lookup. `match` (other readers) counts nothing."""
    index = ExactPrefixIndex()
    index.apply("e1", KVEventBatch(0.0, [BlockStored([1], None)]), now=1.0)
    index.apply("e2", KVEventBatch(0.0, [BlockStored([1, 2], None)]), now=1.0)
    assert index.lookup([1, 2, 3]) == {"e1": 1, "e2": 2}
    assert index.lookup([9, 1]) == {}
    assert index.match([1, 2]) == {"e1": 1, "e2": 2}
    assert (index.lookups, index.lookup_blocks, index.lookup_hits) == (2, 5, 2)


def test_scorer_adds_fresh_engine_reports_to_its_guesses_per_endpoint() -> None:
    scorer = plugin("prefix-cache-scorer", {"kvEvents": True, "kvEventsSubscribe": False})
    pool = [state(1), state(2), state(3)]
    prompt = A + B + C + B
    req = request(prompt=prompt)
    # This replica routed the prompt to endpoint 1: the approximate index has it there.
    scorer.post_cycle(CycleState(NOW), req, ProfileResult("p", (pool[0],)))
    exact = scorer.exact
    assert exact is not None
    hashes = engine_block_hashes("base", prompt, 16)

    def scores(now: float = NOW) -> list[float]:
        out = scorer.score(CycleState(now), req, pool)
        return [float(out)] * 3 if isinstance(out, float) else list(out)

    assert scores() == [1.0, 0.0, 0.0]
    # Engines 2 and 3 report blocks of it (requests another replica routed); engine 1 reports
    # only its first block (the rest still queued there): the longer match counts.
    exact.stored(key(1), hashes[:1], NOW)
    exact.stored(key(2), hashes[:2], NOW)
    exact.stored(key(3), hashes[:3], NOW)
    assert scores() == [1.0, 0.5, 0.75]
    # This replica routes another prompt to endpoint 2, whose feed then stays silent: after
    # `kvEventsStaleAfterS` its engine reports no longer count.
    scorer.post_cycle(CycleState(NOW + 1), request(prompt=C * 4), ProfileResult("p", (pool[1],)))
    assert scores(NOW + 5.9) == [1.0, 0.5, 0.75]
    assert scores(NOW + 6) == [1.0, 0.0, 0.75]


def test_cold_affinity_peers_only_waits_for_another_routers_blocks() -> None:
    params = {
        "kvEvents": True,
        "kvEventsSubscribe": False,
        "coldAffinity": 0.2,
        "coldAffinityBlocks": 8,
        "coldAffinityPeersOnly": True,
        "coldAffinityPeerWindowS": 30,
    }
    scorer = plugin("prefix-cache-scorer", params)
    exact = scorer.exact
    assert exact is not None
    pool = [state(1), state(2), state(3)]
    mine, theirs, new = "m" * 1024, "t" * 1024, "n" * 1024  # 16 blocks each

    def scores(prompt: str, now: float = NOW) -> list[float]:
        out = scorer.score(CycleState(now), request(prompt=prompt), pool)
        return [float(out)] * 3 if isinstance(out, float) else list(out)

    def engine_stores(endpoint: int, prompt: str, now: float) -> None:
        hashes = engine_block_hashes("base", prompt, 16)
        # As vLLM sends a request's run: a chain of 10 (parent None), then the rest.
        events: list[BlockStored | BlockRemoved | AllBlocksCleared] = [
            BlockStored(hashes[:10], None),
            BlockStored(hashes[10:], hashes[9]),
        ]
        exact.apply(key(endpoint), KVEventBatch(now, events, 0), now)

    # One router so far: the engine stores what this replica sent it; no cold push.
    scorer.post_cycle(CycleState(NOW), request(prompt=mine), ProfileResult("p", (pool[0],)))
    engine_stores(1, mine, NOW)
    assert scores(mine)[0] == 1.0
    assert scores(new) == [0.0] * 3
    # An engine stores the head of a prompt this replica never sent it: another router exists.
    engine_stores(2, theirs, NOW + 1)
    assert sorted(scores(new, NOW + 1)) == [0.0, 0.0, 0.2]
    # The sighting keeps the rule on for coldAffinityPeerWindowS, then it lapses.
    assert sorted(scores(new, NOW + 30.9)) == [0.0, 0.0, 0.2]
    assert scores(new, NOW + 31) == [0.0] * 3
    # The head this replica sent, stored again on the same engine (evicted, then re-sent):
    # still its own.
    engine_stores(1, mine, NOW + 40)
    assert scores(new, NOW + 40) == [0.0] * 3


def test_cold_affinity_peers_only_needs_kv_events() -> None:
    with pytest.raises(ValueError, match="coldAffinityPeersOnly needs kvEvents"):
        plugin("prefix-cache-scorer", {"coldAffinity": 0.2, "coldAffinityPeersOnly": True})


def test_predicted_ttft_scorer_reads_characters_from_the_shared_match() -> None:
    scorer = plugin("prefix-cache-scorer")
    req = request(prompt=A + B + "z" * 10)
    scorer.post_cycle(CycleState(NOW), req, ProfileResult("p", (state(1),)))
    assert scorer.matched(CycleState(NOW), req) == {key(1): 128}


def test_sent_heads_are_bounded_and_a_forgotten_one_reads_as_foreign() -> None:
    from poolkeeper.scheduling.exact_prefix import SENT_HEADS

    index = ExactPrefixIndex()
    for h in range(SENT_HEADS + 1):
        index.sent("e", h, NOW)
    index.stored("e", [SENT_HEADS], NOW, head=True)  # the newest: sent by this EPP
    assert index.foreign_at == float("-inf")
    index.stored("e", [5], NOW, head=False)  # not a chain's head: says nothing
    assert index.foreign_at == float("-inf")
    index.stored("e", [0], NOW + 1, head=True)  # the oldest, forgotten
    assert index.foreign_at == NOW + 1
    index.stored("other", [SENT_HEADS], NOW + 2, head=True)  # sent elsewhere, not there
    assert index.foreign_at == NOW + 2


def test_unreported_sent_heads_age_out_without_being_read() -> None:
    """An endpoint whose engine never reports (events off there, requests aborted) must not
    grow the EPP's memory with every prompt it is sent."""
    index = ExactPrefixIndex(stale_after_s=5.0)
    for i in range(2_000):
        index.sent("e", i, NOW + i * 0.1)  # 10 new prompts a second, never reported
    assert len(index._pending["e"]) <= 51  # the last 5 s of them
    assert index.heads("e", NOW + 199.95) == 50


def test_heads_count_reported_chain_heads_and_this_epps_unreported_ones() -> None:
    index = ExactPrefixIndex(stale_after_s=5.0)
    index.stored("e", [1, 2], NOW, head=True)
    index.stored("e", [3], NOW, head=False)  # a chain's continuation: no new head
    index.stored("e", [7], NOW, head=True)
    assert index.heads("e", NOW) == 2
    # Sent here but not yet scheduled (no event): counted, for stale_after_s at most.
    index.sent("e", 9, NOW)
    index.sent("e", 1, NOW)  # already reported: not counted twice
    assert index.heads("e", NOW + 1) == 3
    assert index.heads("e", NOW + 5.5) == 2
    index.sent("e", 11, NOW + 6)
    index.stored("e", [11], NOW + 6.1, head=True)  # reported now: once, not twice
    assert index.heads("e", NOW + 6.2) == 3
    index.removed("e", [7], NOW + 7)
    assert index.heads("e", NOW + 7) == 2
    index.cleared("e", NOW + 8)
    assert index.heads("e", NOW + 8) == 0
    index.stored("f", [1], NOW, head=True)
    index.forget_endpoints({"e"})
    assert index.heads("f", NOW) == 0


def test_balanced_cold_affinity_skips_an_endpoint_holding_more_than_its_share() -> None:
    params = {
        "kvEvents": True,
        "kvEventsSubscribe": False,
        "coldAffinity": 0.2,
        "coldAffinityBlocks": 8,
    }
    pool = [state(1), state(2), state(3)]
    new = "n" * 1024

    def pushed(extra: dict[str, object], heads: dict[int, int]) -> int:
        scorer = plugin("prefix-cache-scorer", {**params, **extra})
        exact = scorer.exact
        assert exact is not None
        for endpoint, n in heads.items():
            for h in range(n):
                exact.stored(key(endpoint), [endpoint * 1000 + h], NOW, head=True)
        out = scorer.score(CycleState(NOW), request(prompt=new), pool)
        assert not isinstance(out, float)
        (i,) = [i for i, s in enumerate(out) if s == 0.2]
        return i

    owner = pushed({}, {})
    # The plain ring's owner, whatever it already holds.
    assert pushed({}, {owner + 1: 3}) == owner
    # Bounded: 3 heads of 4 in all is at the bound ceil((3 + 1) / 3) = 2: the next one.
    assert pushed({"coldAffinityBalance": 1.0}, {owner + 1: 3}) != owner
    # Within its share (1 of 3, bound 2) it stays the owner; a looser bound keeps it too.
    assert pushed({"coldAffinityBalance": 1.0}, {1: 1, 2: 1, 3: 1}) == owner
    assert pushed({"coldAffinityBalance": 3.0}, {owner + 1: 3}) == owner


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"coldAffinity": 0.2, "coldAffinityBalance": 1.0}, "coldAffinityBalance needs kvEvents"),
        ({"kvEvents": True, "coldAffinityBalance": 0.5}, "must be 0 \\(off\\) or >= 1"),
    ],
)
def test_cold_affinity_balance_needs_events_and_a_bound_of_at_least_one(
    params: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        plugin("prefix-cache-scorer", params)


@pytest.mark.parametrize(
    ("params", "follows"),
    [
        ({}, False),  # the default: no KV events, nothing to connect to
        ({"kvEvents": True, "kvEventsSubscribe": False}, False),  # fed in-process
        ({"kvEvents": True}, True),
    ],
)
async def test_the_scheduler_follows_endpoints_only_when_its_prefix_scorer_subscribes(
    params: dict[str, object], follows: bool
) -> None:
    """Without a subscription the runtime registers no endpoint listener (one call per
    datastore write otherwise, for nothing)."""
    from poolkeeper.scheduling.build import build_scheduler
    from poolkeeper.scheduling.config import SchedulingConfig
    from poolkeeper.scheduling.plugins.prefix_scorer import PrefixCacheScorer
    from poolkeeper.scheduling.presets import preset_document

    doc = preset_document("default")
    for p in doc["plugins"]:
        if p["type"] == "prefix-cache-scorer":
            p["parameters"].update(params)
    scheduler = build_scheduler(SchedulingConfig.model_validate(doc), rng=random.Random(1))
    assert scheduler.follows_endpoints is follows
    (scorer,) = [p for p in scheduler.plugins.values() if isinstance(p, PrefixCacheScorer)]
    assert scorer.follows is follows
    if scorer._subscriber is not None:
        scheduler.follow_endpoints(["127.0.0.1:1"])  # connects (and retries) in the background
        await scorer._subscriber.close()
