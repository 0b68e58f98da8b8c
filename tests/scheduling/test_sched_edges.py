"""Edges of the built-in plugins that mutation testing found untested (docs/testing.md).

Thresholds at their exact value, `countUnseen` both ways in every load filter, clocks near
zero, unclamped affine scores, tie-breaks and the names plugins are built with.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

import pytest

from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.scheduling.interfaces import AffineScores, CycleState, ProfileResult, TypedName
from poolkeeper.scheduling.plugins.builtins import builtin_registry
from poolkeeper.scheduling.plugins.decision_tree import (
    DecisionTreeFilter,
    DecisionTreeParams,
    tree_references,
)
from poolkeeper.scheduling.plugins.filters import LoraAffinityFilter, LoraAffinityParams
from poolkeeper.scheduling.plugins.scorers import inverse_min_max
from poolkeeper.scheduling.prefix import PrefixIndex, prefix_hashes
from poolkeeper.scheduling.registry import BuildContext
from poolkeeper.scheduling.stats import SchedulingStats
from poolkeeper.scheduling.types import LLMRequest
from tests.scheduling.sched_factories import NOW, cycle, key, plugin, request, state


def named(type_: str, name: str, params: dict[str, Any] | None = None, seed: int = 1) -> Any:
    spec = builtin_registry().get(type_)
    assert spec is not None

    def no_refs(ref: str) -> Any:
        raise AssertionError(ref)

    ctx = BuildContext(rng=random.Random(seed), resolve_filter=no_refs, staleness_s=0.2)
    return spec.factory(TypedName(type_, name), spec.params.model_validate(params or {}), ctx)


def keys(endpoints: object) -> list[str]:
    assert isinstance(endpoints, list | tuple)
    return [s.endpoint.hostport for s in endpoints]


def raw(scores: object, n: int) -> list[float]:
    """Scores as the profile adds them: an affine form is not clamped there."""
    if isinstance(scores, AffineScores):
        return [scores.offset + scores.scale * v for v in scores.values]
    if isinstance(scores, float | int):
        return [float(scores)] * n
    assert isinstance(scores, list)
    return scores


@pytest.mark.parametrize(
    "type_",
    [
        "least-queue-filter",
        "least-kv-cache-filter",
        "lora-affinity-filter",
        "has-capacity-filter",
        "saturation-filter",
        "inflight-load-scorer",
        "weighted-random-picker",
        "max-score-picker",
        "queue-scorer",
    ],
)
def test_plugins_keep_the_name_they_are_built_with(type_: str) -> None:
    built = named(type_, "my-instance")
    assert built.typed_name == TypedName(type_, "my-instance")
    assert repr(built).endswith(f"(my-instance ({type_}))")


# -- load filters: countUnseen both ways -------------------------------------------------------

# pod1: 3 waiting scraped + 4 sent since the scrape; pod2: 5 waiting, nothing unseen.
UNSEEN_QUEUE = [state(1, waiting=3, unseen=4), state(2, waiting=5)]
# pod1: KV 0.5 scraped + 3000 unseen tokens of a 10,000-token cache (= 0.8); pod2: KV 0.6.
UNSEEN_KV = [
    state(1, kv=0.5, unseen=1, unseen_tokens=3000, num_gpu_blocks=100, block_size=100),
    state(2, kv=0.6),
]


@pytest.mark.parametrize(("count_unseen", "want"), [(True, [2]), (False, [1])])
def test_least_queue_filter_counts_unseen_only_when_asked(
    count_unseen: bool, want: list[int]
) -> None:
    f = plugin("least-queue-filter", {"countUnseen": count_unseen})
    assert keys(f.filter(cycle(), request(), UNSEEN_QUEUE)) == [key(i) for i in want]


@pytest.mark.parametrize(("count_unseen", "want"), [(True, [2]), (False, [1])])
def test_least_kv_filter_counts_unseen_only_when_asked(count_unseen: bool, want: list[int]) -> None:
    f = plugin("least-kv-cache-filter", {"countUnseen": count_unseen})
    assert keys(f.filter(cycle(), request(), UNSEEN_KV)) == [key(i) for i in want]


@pytest.mark.parametrize("inclusive", [True, False])
@pytest.mark.parametrize(("count_unseen", "want"), [(True, [2]), (False, [1, 2])])
def test_low_queue_filter_counts_unseen_only_when_asked(
    inclusive: bool, count_unseen: bool, want: list[int]
) -> None:
    # Threshold 6: pod1 is at 3 scraped, 7 with unseen; pod2 at 5.
    params = {"threshold": 6, "inclusive": inclusive, "countUnseen": count_unseen}
    f = plugin("low-queue-filter", params)
    assert keys(f.filter(cycle(), request(), UNSEEN_QUEUE)) == [key(i) for i in want]


@pytest.mark.parametrize(
    ("count_unseen", "pool", "want"),
    [
        (True, UNSEEN_QUEUE, [2]),  # pod1's 3 + 4 unseen > 5
        (False, UNSEEN_QUEUE, [1, 2]),
        (True, UNSEEN_KV, [2]),  # pod1's 0.5 + 0.3 unseen > 0.7
        (False, UNSEEN_KV, [1, 2]),
    ],
)
def test_has_capacity_filter_counts_unseen_only_when_asked(
    count_unseen: bool, pool: list[EndpointState], want: list[int]
) -> None:
    params = {"queueThreshold": 5, "kvCacheThreshold": 0.7, "countUnseen": count_unseen}
    f = plugin("has-capacity-filter", params)
    assert keys(f.filter(cycle(), request(), pool)) == [key(i) for i in want]


# -- saturation and staleness filters ------------------------------------------------------------

OVERLOADED = state(9, waiting=100)


def test_saturation_filter_keeps_an_endpoint_exactly_at_the_staleness_limit() -> None:
    f = plugin("saturation-filter", staleness_s=0.2)
    edge = state(1, updated_at=NOW - 0.2)
    assert keys(f.filter(cycle(), request(), [edge, OVERLOADED])) == [key(1)]
    just_over = state(1, updated_at=NOW - 0.2001)
    fresh = state(2)
    assert keys(f.filter(cycle(), request(), [just_over, fresh])) == [key(2)]


def test_saturation_filter_kv_limit_is_threshold_times_one_plus_headroom() -> None:
    # KV limit 0.8 x 1.25 = 1.0: a pod at 0.7 KV is fine; the queue-overloaded one is not.
    f = plugin("saturation-filter", {"headroom": 0.25})
    assert keys(f.filter(cycle(), request(), [state(1, kv=0.7), OVERLOADED])) == [key(1)]
    f = plugin("saturation-filter", {"headroom": 0.0})
    assert keys(f.filter(cycle(), request(), [state(1, kv=0.85), state(2, kv=0.5)])) == [key(2)]


def test_saturation_filter_with_a_clock_near_zero() -> None:
    f = plugin("saturation-filter")
    early = CycleState(0.6)  # a monotonic clock that started 0.6 s ago
    never_scraped = state(1, updated_at=0.0)
    scraped = state(2, updated_at=0.5)
    assert keys(f.filter(early, request(), [never_scraped, scraped])) == [key(2)]


@pytest.mark.parametrize(
    ("count_unseen", "want"),
    [(True, [2]), (False, [1, 2])],
)
def test_saturation_filter_counts_unseen_requests_only_when_asked(
    count_unseen: bool, want: list[int]
) -> None:
    # Queue limit 5 x 1.5 = 7.5: pod1 has 3 waiting + 6 unseen.
    f = plugin("saturation-filter", {"countUnseen": count_unseen})
    pool = [state(1, waiting=3, unseen=6), state(2, waiting=1)]
    assert keys(f.filter(cycle(), request(), pool)) == [key(i) for i in want]


@pytest.mark.parametrize(("count_unseen", "want"), [(True, [2]), (False, [1, 2])])
def test_saturation_filter_counts_unseen_tokens_only_when_asked(
    count_unseen: bool, want: list[int]
) -> None:
    # KV limit 0.8 x 1.0 = 0.8 (headroom 0): pod1 is 0.5 scraped, 0.8 + 0.3 = 1.0 with unseen.
    f = plugin("saturation-filter", {"countUnseen": count_unseen, "headroom": 0.0})
    pool = [
        state(1, kv=0.5, unseen_tokens=5000, num_gpu_blocks=100, block_size=100),
        state(2, kv=0.1),
    ]
    assert keys(f.filter(cycle(), request(), pool)) == [key(i) for i in want]


def test_saturation_filter_counts_an_out_of_range_kv_as_full() -> None:
    # Limit 1.3: full KV is 1.0 / 0.8 = 1.25 (kept); 1.3 as reported would be 1.625.
    f = plugin("saturation-filter", {"headroom": 0.3})
    pool = [state(1, kv=1.3), state(2, kv=math.nan), OVERLOADED]
    assert keys(f.filter(cycle(), request(), pool)) == [key(1), key(2)]


def test_stale_metrics_filter_with_a_clock_near_zero() -> None:
    f = plugin("stale-metrics-filter", staleness_s=0.2)
    early = CycleState(0.6)
    pool = [state(1, updated_at=0.0), state(2, updated_at=0.5)]
    assert keys(f.filter(early, request(), pool)) == [key(2)]


# -- LoRA affinity filter: the threshold is a strict "<" ---------------------------------------


class FixedRandom(random.Random):
    def __init__(self, value: float) -> None:
        super().__init__(0)
        self.value = value

    def random(self) -> float:
        return self.value


@pytest.mark.parametrize(("draw", "want"), [(0.49, [1]), (0.5, [2])])
def test_lora_affinity_filter_threshold_is_strict(draw: float, want: list[int]) -> None:
    name = TypedName("lora-affinity-filter", "x")
    f = LoraAffinityFilter(name, LoraAffinityParams(threshold=0.5), FixedRandom(draw))
    pool = [state(1, active=("a",), max_adapters=2), state(2, max_adapters=2)]
    assert keys(f.filter(cycle(), request("a"), pool)) == [key(i) for i in want]


# -- scorers -------------------------------------------------------------------------------------


def test_inverse_min_max_default_span_is_plain_min_max() -> None:
    assert raw(inverse_min_max([0.0, 0.5]), 2) == [1.0, 0.0]
    assert raw(inverse_min_max([2.0, 3.0, 2.5], min_span=4.0), 3) == [1.0, 0.75, 0.875]


@pytest.mark.parametrize("type_", ["queue-scorer", "running-requests-size-scorer"])
@pytest.mark.parametrize("count_unseen", [True, False])
def test_min_span_applies_with_and_without_unseen(type_: str, count_unseen: bool) -> None:
    scorer = plugin(type_, {"minSpan": 8, "countUnseen": count_unseen})
    pool = [state(1), state(2, waiting=2, running=2)]
    assert raw(scorer.score(cycle(), request(), pool), 2) == [1.0, 0.75]


@pytest.mark.parametrize(
    ("kv", "want"),
    [
        ([1.5, 0.5], [0.0, 0.5]),  # only the maximum out of range
        ([-0.2, 0.5], [1.0, 0.5]),  # only the minimum out of range
        ([math.nan, 0.5], [0.0, 0.5]),
        ([0.5, math.nan], [0.5, 0.0]),
    ],
)
def test_kv_scorer_clamps_before_the_profile_adds_it(kv: list[float], want: list[float]) -> None:
    # The profile adds the affine form without clamping: out-of-range scrapes must be clamped
    # by the scorer itself.
    scorer = plugin("kv-cache-scorer")
    pool = [state(i, kv=v) for i, v in enumerate(kv)]
    assert raw(scorer.score(cycle(), request(), pool), 2) == pytest.approx(want)


def test_prefix_scorers_keep_their_own_hashes_in_one_cycle() -> None:
    small = named("prefix-cache-scorer", "small", {"blockSize": 4})
    large = named("prefix-cache-scorer", "large", {"blockSize": 8})
    req = request(prompt="x" * 64)
    shared = cycle()
    assert len(small.hashes(shared, req)) == 16
    assert len(large.hashes(shared, req)) == 8


# -- pickers -------------------------------------------------------------------------------------


def test_max_score_picker_breaks_a_two_way_tie_at_random() -> None:
    picker = named("max-score-picker", "p", {"maxNumOfEndpoints": 1}, seed=3)
    cands = [state(1), state(2), state(3)]
    picks = {picker.pick(cands, [0.5, 0.9, 0.9])[0] for _ in range(40)}
    assert picks == {1, 2}


def test_weighted_random_picker_never_repeats_an_endpoint() -> None:
    for seed in range(20):
        picker = named("weighted-random-picker", "p", {"maxNumOfEndpoints": 3}, seed=seed)
        picked = picker.pick([state(1), state(2), state(3)], [0.5, 0.0, 0.0])
        assert picked[0] == 0  # the only positive score comes first
        assert sorted(picked) == [0, 1, 2]


# -- decision tree -------------------------------------------------------------------------------


def test_tree_references_name_every_path() -> None:
    params = DecisionTreeParams.model_validate(
        {
            "current": "a",
            "nextOnSuccess": {"pluginRef": "b"},
            "nextOnFailure": {
                "decisionTree": {"current": "c", "nextOnSuccessOrFailure": "d"},
            },
        }
    )
    assert tree_references(params) == [
        ("current", "a"),
        ("nextOnSuccess.pluginRef", "b"),
        ("nextOnFailure.decisionTree.current", "c"),
        ("nextOnFailure.decisionTree.nextOnSuccessOrFailure", "d"),
    ]


class CycleCheckingFilter:
    """Keeps the endpoints listed in `keep`; records the cycle each call received."""

    def __init__(self, keep: set[str]) -> None:
        self.typed_name = TypedName("fake-filter", "fake")
        self.keep = keep
        self.cycles: list[object] = []

    def filter(
        self, cycle: CycleState, request: LLMRequest, candidates: Sequence[EndpointState]
    ) -> Sequence[EndpointState]:
        self.cycles.append(cycle)
        return [s for s in candidates if s.endpoint.hostport in self.keep]


def test_decision_tree_passes_the_cycle_to_every_node() -> None:
    first = CycleCheckingFilter({key(1)})
    on_success = CycleCheckingFilter({key(1)})
    nothing = CycleCheckingFilter(set())
    on_failure = CycleCheckingFilter({key(2)})
    filters = {"first": first, "ok": on_success, "none": nothing, "fallback": on_failure}
    ctx = BuildContext(rng=random.Random(1), resolve_filter=filters.__getitem__, staleness_s=0.2)
    name = TypedName("decision-tree-filter", "tree")
    tree = DecisionTreeFilter.build(
        name,
        DecisionTreeParams.model_validate(
            {
                "current": "none",
                "nextOnFailure": {
                    "decisionTree": {
                        "current": "first",
                        "nextOnSuccess": "ok",
                        "nextOnFailure": "fallback",
                    }
                },
            }
        ),
        ctx,
    )
    assert isinstance(tree.on_failure, DecisionTreeFilter)
    assert tree.on_failure.typed_name == name  # nested nodes carry the tree's name
    shared = cycle()
    pool = [state(1), state(2)]
    assert keys(tree.filter(shared, request(), pool)) == [key(1)]
    assert first.cycles == on_success.cycles == nothing.cycles == [shared]
    failing = DecisionTreeFilter(name, nothing, None, on_failure)
    assert keys(failing.filter(shared, request(), pool)) == [key(2)]
    assert on_failure.cycles == [shared]


# -- prefix index --------------------------------------------------------------------------------


def test_prefix_index_rejects_a_zero_capacity_and_reports_unknown_endpoints() -> None:
    with pytest.raises(ValueError, match=r"^capacity_per_endpoint must be >= 1$"):
        PrefixIndex(0)
    idx = PrefixIndex(4)
    assert idx.blocks("10.9.9.9:8000") == 0
    idx.insert(key(1), prefix_hashes("m", "y" * 16, block_size=4, max_blocks=8))
    assert idx.blocks(key(1)) == 4


def test_prefix_match_follows_only_endpoints_that_held_every_block_so_far() -> None:
    idx = PrefixIndex(8)
    idx.insert("a:1", [1])
    idx.insert("b:1", [1, 2])
    idx.insert("c:1", [2])  # holds block 2 but not block 1: no leading match
    assert idx.match([1, 2]) == {"a:1": 1, "b:1": 2}


def test_stale_metrics_filter_drops_never_scraped_even_when_the_clock_is_younger() -> None:
    f = plugin("stale-metrics-filter", staleness_s=0.2)
    early = CycleState(0.1)  # younger than the staleness window: 0.0 is not "too old"
    pool = [state(1, updated_at=0.0), state(2, updated_at=0.05)]
    assert keys(f.filter(early, request(), pool)) == [key(2)]


def test_prefix_scorers_report_their_own_match_for_the_pick() -> None:
    small = named("prefix-cache-scorer", "small", {"blockSize": 4})
    large = named("prefix-cache-scorer", "large", {"blockSize": 8})
    small_stats, large_stats = SchedulingStats(), SchedulingStats()
    small.attach_stats(small_stats)
    large.attach_stats(large_stats)
    req = request(prompt="x" * 64)
    pod = state(1)
    small.index.insert(key(1), prefix_hashes("base", "x" * 64, block_size=4, max_blocks=256))
    shared = cycle()
    small.score(shared, req, [pod])
    large.score(shared, req, [pod])  # matches nothing
    result = ProfileResult("p", (pod,))
    small.post_cycle(shared, req, result)
    large.post_cycle(shared, req, result)
    assert small_stats.prefix_hit_bytes.sum == 64  # all 16 blocks of 4 characters
    assert large_stats.prefix_hit_bytes.sum == 0


def test_a_prompt_too_short_to_hash_reports_no_match() -> None:
    scorer = named("prefix-cache-scorer", "p", {"blockSize": 64})
    stats = SchedulingStats()
    scorer.attach_stats(stats)
    req = request(prompt="short")
    shared = cycle()
    assert scorer.score(shared, req, [state(1)]) == 0.0
    scorer.post_cycle(shared, req, ProfileResult("p", (state(1),)))
    assert (stats.prefix_hit_bytes.count, stats.prefix_hit_bytes.sum) == (1, 0)
