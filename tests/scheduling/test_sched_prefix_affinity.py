"""The prefix-affinity filter: holders only while balanced, everyone once the holders are out of
balance, and nothing narrowed for short prompts, partial matches or unknown prefixes."""

from __future__ import annotations

from typing import Any

import pytest

from poolkeeper.errors import ConfigError
from poolkeeper.scheduling.interfaces import CycleState, ProfileResult
from poolkeeper.scheduling.plugins.prefix_affinity import PrefixAffinityFilter
from tests.scheduling.sched_factories import NOW, cycle, key, request, scheduler, state

SYSTEM = "s" * 4096  # 64 blocks of 64 characters: a shared system prompt


def _filtered_doc(
    filter_type: str, params: dict[str, Any], prefix_weight: int, queue_weight: int
) -> dict[str, Any]:
    """`filter_type` (with `params`) before the prefix scorer and a queue scorer."""
    return {
        "plugins": [
            {"type": filter_type, "parameters": params},
            {"type": "prefix-cache-scorer"},
            {"type": "queue-scorer"},
            {"type": "max-score-picker", "parameters": {"maxNumOfEndpoints": 1}},
        ],
        "schedulingProfiles": [
            {
                "name": "p",
                "plugins": [
                    {"pluginRef": filter_type},
                    {"pluginRef": "prefix-cache-scorer", "weight": prefix_weight},
                    {"pluginRef": "queue-scorer", "weight": queue_weight},
                    {"pluginRef": "max-score-picker"},
                ],
            }
        ],
    }


def _doc(**params: Any) -> dict[str, Any]:
    """The prefix scorer, the filter reading it, and a queue scorer that would outvote it."""
    return _filtered_doc("prefix-affinity-filter", params, prefix_weight=1, queue_weight=10)


def _kept(sched: Any, prompt: str, pool: list[Any]) -> list[str]:
    filt = sched.plugins["prefix-affinity-filter"]
    return [s.key for s in filt.filter(cycle(), request(prompt=prompt), pool)]


def _holder(sched: Any, prompt: str, pool: list[Any], i: int) -> None:
    """Record endpoint `i` of `pool` as holding `prompt` (as after a decision for it)."""
    scorer = sched.plugins["prefix-cache-scorer"]
    scorer.post_cycle(cycle(), request(prompt=prompt), ProfileResult("p", (pool[i],)))


def test_holders_only_while_balanced_everyone_when_not() -> None:
    sched = scheduler(_doc())
    idle = [state(i) for i in range(1, 5)]
    _holder(sched, SYSTEM + "first question", idle, 1)
    prompt = SYSTEM + "another question"
    assert _kept(sched, prompt, idle) == [key(2)]
    # The holder is busier by 16 requests (not more): still balanced.
    busy = [state(1, running=20), state(2, running=36), state(3, running=30), state(4, running=25)]
    assert _kept(sched, prompt, busy) == [key(2)]
    # 17 more and 1.85x: affinity yields, every candidate stays for the scorers.
    skewed = [state(1, running=20), state(2, running=30, unseen=7), state(3, running=40)]
    assert _kept(sched, prompt, skewed) == [key(i) for i in range(1, 4)]
    # Far more in absolute terms but under 1.5x: still balanced (a busy fleet).
    heavy = [state(1, running=100), state(2, running=140), state(3, running=120)]
    assert _kept(sched, prompt, heavy) == [key(2)]


def test_the_scheduler_keeps_a_busy_holder_the_queue_scorer_would_leave() -> None:
    pool = [state(1, waiting=0), state(2, waiting=6), state(3, waiting=1)]
    for doc, expected in ((_doc(), key(2)), (_doc(balanceAbsThreshold=3), key(1))):
        sched = scheduler(doc)
        _holder(sched, SYSTEM + "q0", pool, 1)
        got = sched.schedule(request(prompt=SYSTEM + "q1", request_id="r2"), pool, now=100.0)
        assert got.primary.key == expected


def test_short_partial_and_unknown_prompts_are_not_narrowed() -> None:
    sched = scheduler(_doc())
    pool = [state(i) for i in range(1, 4)]
    everyone = [key(i) for i in range(1, 4)]
    short = "x" * 1024  # 16 blocks: under minMatchBlocks
    _holder(sched, short, pool, 0)
    assert _kept(sched, short + "more", pool) == everyone
    _holder(sched, SYSTEM, pool, 2)
    # Holds 4,096 of 16,000 characters: under minMatchRatio 0.3.
    assert _kept(sched, SYSTEM + "u" * 11_904, pool) == everyone
    assert _kept(sched, SYSTEM + "u" * 11_904, pool[:1]) == [key(1)]
    assert _kept(sched, "never seen " * 600, pool) == everyone
    # Every candidate holds it: nothing to narrow.
    _holder(sched, SYSTEM, pool, 0)
    _holder(sched, SYSTEM, pool, 1)
    assert _kept(sched, SYSTEM + "q", pool) == everyone


def test_only_when_stale_narrows_only_while_a_holder_is_stale() -> None:
    sched = scheduler(_doc(onlyWhenStale=True))
    fresh = [state(i) for i in range(1, 4)]
    _holder(sched, SYSTEM + "q0", fresh, 1)
    prompt = SYSTEM + "q1"
    # Every holder fresh: affinity is left to the scorers.
    assert _kept(sched, prompt, fresh) == [key(1), key(2), key(3)]
    # The holder's scrape is late (older than the 200 ms staleness): it is kept alone, so
    # the stale-metrics filter after it cannot send the prompt to the endpoint scraped last.
    late = [state(1), state(2, updated_at=NOW - 0.5), state(3)]
    assert _kept(sched, prompt, late) == [key(2)]
    # Out of balance, even a stale holder gives way.
    busy = [state(1), state(2, updated_at=NOW - 0.5, running=40), state(3)]
    assert _kept(sched, prompt, busy) == [key(1), key(2), key(3)]


def test_listed_first_it_keeps_a_stale_holder_through_the_stale_metrics_filter() -> None:
    doc = _doc(onlyWhenStale=True)
    doc["plugins"].append({"type": "stale-metrics-filter"})
    doc["schedulingProfiles"][0]["plugins"].insert(1, {"pluginRef": "stale-metrics-filter"})
    pool = [state(1), state(2, updated_at=NOW - 0.5), state(3)]
    for expected, d in ((key(2), doc), (None, _doc())):
        if expected is None:  # without the filter: the stale holder is dropped
            d = {**doc, "plugins": doc["plugins"][1:]}
            d["schedulingProfiles"] = [
                {"name": "p", "plugins": doc["schedulingProfiles"][0]["plugins"][1:]}
            ]
        sched = scheduler(d)
        _holder(sched, SYSTEM + "q0", pool, 1)
        got = sched.schedule(request(prompt=SYSTEM + "q1", request_id="r2"), pool, now=NOW)
        assert (got.primary.key == key(2)) is (expected is not None)


def test_a_missing_or_wrong_prefix_scorer_is_a_config_error() -> None:
    doc = _doc(prefixScorer="queue-scorer")
    with pytest.raises(ConfigError, match="not a prefix-cache-scorer"):
        scheduler(doc)
    doc = _doc(prefixScorer="nope")
    with pytest.raises(ConfigError, match="nope"):
        scheduler(doc)


def _stale_doc(**params: Any) -> dict[str, Any]:
    """A stale-metrics-filter reading the prefix index, and a queue scorer."""
    return _filtered_doc("stale-metrics-filter", params, prefix_weight=3, queue_weight=1)


def _stale_kept(sched: Any, prompt: str, pool: list[Any]) -> list[str]:
    filt = sched.plugins["stale-metrics-filter"]
    return [s.key for s in filt.filter(cycle(), request(prompt=prompt), pool)]


def test_stale_filter_keeps_a_late_holder_within_the_grace() -> None:
    sched = scheduler(_stale_doc(prefixScorer="prefix-cache-scorer"))
    pool = [state(1), state(2, updated_at=NOW - 0.204), state(3, updated_at=NOW - 0.5)]
    _holder(sched, SYSTEM + "q0", pool, 1)
    prompt = SYSTEM + "q1"
    # pod2 holds the prompt and its scrape is 4 ms late: kept; pod3 (late, holds nothing) not.
    assert _stale_kept(sched, prompt, pool) == [key(1), key(2)]
    # A prompt nobody holds: the plain rule, every late endpoint dropped.
    assert _stale_kept(sched, "never seen " * 600, pool) == [key(1)]
    # Older than the grace (1 s): the holder is dropped too, it may be gone.
    gone = [state(1), state(2, updated_at=NOW - 1.5), state(3)]
    assert _stale_kept(sched, prompt, gone) == [key(1), key(3)]
    # Never scraped is never "late": dropped whatever it holds.
    never = [state(1), state(2, updated_at=0.0)]
    assert _stale_kept(sched, prompt, never) == [key(1)]


def test_stale_filter_without_prefix_scorer_drops_every_late_endpoint() -> None:
    sched = scheduler(_stale_doc())
    pool = [state(1), state(2, updated_at=NOW - 0.204), state(3)]
    _holder(sched, SYSTEM + "q0", pool, 1)
    assert _stale_kept(sched, SYSTEM + "q1", pool) == [key(1), key(3)]


def test_a_short_or_partial_match_earns_no_grace() -> None:
    sched = scheduler(_stale_doc(prefixScorer="prefix-cache-scorer", holderGraceMs=2000))
    pool = [state(1), state(2, updated_at=NOW - 0.3)]
    short = "x" * 1024  # 16 blocks: under minMatchBlocks
    _holder(sched, short, pool, 1)
    assert _stale_kept(sched, short + "more", pool) == [key(1)]
    _holder(sched, SYSTEM, pool, 1)
    # Holds 4,096 of 16,000 characters: under minMatchRatio 0.3.
    assert _stale_kept(sched, SYSTEM + "u" * 11_904, pool) == [key(1)]
    assert _stale_kept(sched, SYSTEM + "u" * 100, pool) == [key(1), key(2)]


def test_the_scheduler_sends_the_prompt_to_its_late_holder() -> None:
    pool = [state(1, waiting=0), state(2, waiting=1, updated_at=NOW - 0.25), state(3, waiting=0)]
    for params, expected in (({"prefixScorer": "prefix-cache-scorer"}, key(2)), ({}, None)):
        sched = scheduler(_stale_doc(**params))
        _holder(sched, SYSTEM + "q0", pool, 1)
        got = sched.schedule(request(prompt=SYSTEM + "q1", request_id="r2"), pool, now=NOW)
        if expected is None:
            assert got.primary.key != key(2)
        else:
            assert got.primary.key == expected


def test_the_stale_filter_rejects_a_wrong_prefix_scorer() -> None:
    with pytest.raises(ConfigError, match="not a prefix-cache-scorer"):
        scheduler(_stale_doc(prefixScorer="queue-scorer"))


def _affinity(sched: Any) -> PrefixAffinityFilter:
    filt = sched.plugins["prefix-affinity-filter"]
    assert isinstance(filt, PrefixAffinityFilter)
    return filt


def _system(i: int) -> str:
    """A distinct 4,096-character system prompt (64 blocks): group `i`'s shared prefix."""
    return f"group {i:03d} " * 410


def test_cold_balance_places_new_prefixes_evenly() -> None:
    doc = _doc(coldBalance=True)
    doc["plugins"][3]["parameters"]["maxNumOfEndpoints"] = 1
    sched = scheduler(doc)
    pool = [state(i) for i in range(1, 5)]
    placed: dict[str, list[int]] = {}
    for g in range(12):
        got = sched.schedule(request(prompt=_system(g) + "q", request_id=f"g{g}"), pool, now=NOW)
        placed.setdefault(got.primary.key, []).append(g)
    # 12 new prefixes on 4 idle servers: exactly 3 each (a random tie-break stacks them).
    assert sorted(len(v) for v in placed.values()) == [3, 3, 3, 3]
    # A group's later requests follow its holder (affinity), not the placement count.
    holder = next(k for k, v in placed.items() if 0 in v)
    again = sched.schedule(request(prompt=_system(0) + "q2", request_id="again"), pool, now=NOW)
    assert again.primary.key == holder


def test_cold_balance_yields_to_load_and_ignores_short_or_known_prompts() -> None:
    sched = scheduler(_doc(coldBalance=True))
    filt = _affinity(sched)
    pool = [state(1), state(2), state(3)]
    everyone = [key(1), key(2), key(3)]
    for i in (1, 2):  # pod1 and pod2 have each got one new prefix
        c = cycle()
        req = request(prompt=_system(i) + "q")
        assert key(3) in [s.key for s in filt.filter(c, req, pool)]
        filt.post_cycle(c, req, ProfileResult("p", (pool[i - 1],)))
    assert _kept(sched, _system(9) + "q", pool) == [key(3)]
    # The least placed is 17 requests and 1.5x busier than the least loaded: load decides.
    busy = [state(1, running=10), state(2, running=10), state(3, running=27)]
    assert _kept(sched, _system(9) + "q", busy) == everyone
    # Short prompts and prompts someone holds are not cold.
    assert _kept(sched, "x" * 1024, pool) == everyone
    _holder(sched, _system(1) + "q", pool, 0)
    assert _kept(sched, _system(1) + "other", pool) == [key(1)]


def test_cold_balance_counts_decay() -> None:
    sched = scheduler(_doc(coldBalance=True, coldHalfLifeS=10))
    filt = _affinity(sched)
    pool = [state(1), state(2)]
    c = cycle()
    req = request(prompt=_system(1) + "q")
    filt.filter(c, req, pool)
    filt.post_cycle(c, req, ProfileResult("p", (pool[0],)))
    assert _kept(sched, _system(2) + "q", pool) == [key(2)]
    # Ten half-lives later pod1's one placement counts 0.001: both are "least placed" again.
    later = filt.filter(CycleState(NOW + 100), request(prompt=_system(2) + "q"), pool)
    assert [s.key for s in later] == [key(1), key(2)]


def test_cold_slack_lets_the_load_scorers_choose_among_nearly_least_placed() -> None:
    for slack, expected in ((0.5, [key(3)]), (1.0, [key(1), key(2), key(3)])):
        sched = scheduler(_doc(coldBalance=True, coldSlack=slack))
        filt = _affinity(sched)
        pool = [state(1), state(2), state(3)]
        for i in (1, 2):
            c = cycle()
            req = request(prompt=_system(i) + "q")
            filt.filter(c, req, pool)
            filt.post_cycle(c, req, ProfileResult("p", (pool[i - 1],)))
        assert _kept(sched, _system(9) + "q", pool) == expected
