"""Scheduler behaviour: results, fallbacks, errors, defensive checks, profile handlers."""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.errors import FilteredOut, GatewayError, NoReadyEndpoint
from poolkeeper.scheduling.build import build_scheduler
from poolkeeper.scheduling.config import SchedulingConfig
from poolkeeper.scheduling.interfaces import (
    CycleState,
    ProfileResult,
    ProfileRunner,
    Scores,
    TypedName,
)
from poolkeeper.scheduling.plugins.builtins import builtin_registry
from poolkeeper.scheduling.registry import NoParams, PluginKind, PluginRegistry, PluginSpec
from poolkeeper.scheduling.types import LLMRequest
from tests.scheduling.sched_factories import key, request, scheduler, state


def test_no_candidates_is_no_ready_endpoint_503() -> None:
    with pytest.raises(NoReadyEndpoint) as info:
        scheduler("default").schedule(request(), [], now=100.0)
    assert info.value.http_status == 503


def test_everything_filtered_is_429_rejected_saturated() -> None:
    """A pool with endpoints that the filters all drop: upstream's 429 rejected-saturated
    (503 stays for a pool with no endpoint at all)."""
    sched = scheduler({"plugins": [{"type": "low-queue-filter", "parameters": {"threshold": 1}}]})
    with pytest.raises(
        FilteredOut, match=r"passed the filters of scheduling profile 'default'"
    ) as info:
        sched.schedule(request(), [state(1, waiting=5)], now=100.0)
    assert (info.value.http_status, info.value.dropped_reason) == (429, "rejected-saturated")


def test_default_profile_returns_primary_and_ranked_fallbacks() -> None:
    pool = [state(1, waiting=9), state(2, waiting=0), state(3, waiting=3), state(4, waiting=6)]
    result = scheduler("default").schedule(request(), pool, now=100.0)
    assert [t.key for t in result.targets] == [key(2), key(3), key(4), key(1)]
    assert result.profile == "default"
    assert list(result.scores) == [t.key for t in result.targets]
    values = list(result.scores.values())
    assert values == sorted(values, reverse=True)


def test_default_profile_weighs_prefix_hits_against_load() -> None:
    sched = scheduler("default")
    block = 64
    prompt = "".join(f"{i:063d}|" for i in range(8))  # 8 distinct blocks
    assert len(prompt) == 8 * block
    pool = [state(i) for i in range(1, 5)]
    home = sched.schedule(request(prompt=prompt), pool, now=100.0).primary.key
    home_i = int(home.split(".")[3].split(":")[0])
    half = prompt[: 4 * block] + "x" * (4 * block)  # shares 4 of 8 blocks: prefix score 0.5

    def with_home_queue(q: int) -> list[EndpointState]:
        return [state(i, waiting=q if i == home_i else 0) for i in range(1, 5)]

    # Full hit: stays home even when the holder is the most loaded (3 > 2 queue points).
    assert (
        sched.schedule(request(prompt=prompt), with_home_queue(20), now=100.0).primary.key == home
    )
    # Half hit (1.5 points): worth a small imbalance (2 waiting = 0.5 points) ...
    assert sched.schedule(request(prompt=half), with_home_queue(2), now=100.0).primary.key == home
    # ... not a large one (16 waiting = 2 points). (Another half: the previous one is now
    # recorded at home in full.)
    other_half = prompt[: 4 * block] + "y" * (4 * block)
    moved = sched.schedule(request(prompt=other_half), with_home_queue(16), now=100.0)
    assert moved.primary.key != home


def test_default_profile_skips_stale_endpoints() -> None:
    pool = [state(1, updated_at=99.0), state(2, waiting=3), state(3, waiting=3)]
    for seed in range(10):
        result = scheduler("default", seed=seed).schedule(request(), pool, now=100.0)
        assert result.primary.key != key(1)
        assert key(1) not in {t.key for t in result.targets}


def _registry_with(*specs: PluginSpec) -> PluginRegistry:
    registry = builtin_registry()
    for spec in specs:
        registry.register(spec)
    return registry


class ForeignFilter:
    """A buggy custom filter that returns an endpoint that is not a candidate."""

    def __init__(self, tn: TypedName) -> None:
        self.typed_name = tn

    def filter(
        self, cycle: CycleState, req: LLMRequest, candidates: Sequence[EndpointState]
    ) -> Sequence[EndpointState]:
        return [state(99), *candidates[:1]]


class WildScorer:
    def __init__(self, tn: TypedName, values: list[float]) -> None:
        self.typed_name = tn
        self.values = values

    def score(
        self, cycle: CycleState, req: LLMRequest, candidates: Sequence[EndpointState]
    ) -> Scores:
        return self.values[: len(candidates)]


class BadPicker:
    def __init__(self, tn: TypedName) -> None:
        self.typed_name = tn

    def pick(self, candidates: Sequence[EndpointState], scores: Sequence[float]) -> list[int]:
        return [7, 0, 0, -1]


def _build(doc: dict[str, Any], registry: PluginRegistry) -> Any:
    config = SchedulingConfig.model_validate(doc, context={"registry": registry})
    return build_scheduler(config, rng=random.Random(0), registry=registry)


def test_decision_never_names_an_endpoint_outside_the_candidates() -> None:
    registry = _registry_with(
        PluginSpec("foreign", PluginKind.FILTER, NoParams, lambda tn, p, c: ForeignFilter(tn), "x"),
        PluginSpec("bad-picker", PluginKind.PICKER, NoParams, lambda tn, p, c: BadPicker(tn), "x"),
    )
    sched = _build({"plugins": [{"type": "foreign"}, {"type": "bad-picker"}]}, registry)
    pool = [state(1), state(2)]
    result = sched.schedule(request(), pool, now=100.0)
    assert [t.key for t in result.targets] == [key(1)]


def test_out_of_range_custom_scores_are_clamped() -> None:
    values = [5.0, -1.0, math.nan, 0.5]
    registry = _registry_with(
        PluginSpec(
            "wild", PluginKind.SCORER, NoParams, lambda tn, p, c: WildScorer(tn, values), "x"
        )
    )
    picker = {"type": "max-score-picker", "parameters": {"maxNumOfEndpoints": 4}}
    refs = [{"pluginRef": "wild", "weight": 2}, {"pluginRef": "max-score-picker"}]
    doc = {
        "plugins": [{"type": "wild"}, picker],
        "schedulingProfiles": [{"name": "p", "plugins": refs}],
    }
    result = _build(doc, registry).schedule(request(), [state(i) for i in range(4)], now=100.0)
    assert result.scores == {key(0): 2.0, key(3): 1.0, key(1): 0.0, key(2): 0.0}


def test_scorer_with_wrong_length_is_an_error() -> None:
    registry = _registry_with(
        PluginSpec(
            "short", PluginKind.SCORER, NoParams, lambda tn, p, c: WildScorer(tn, [1.0]), "x"
        )
    )
    sched = _build({"plugins": [{"type": "short"}]}, registry)
    with pytest.raises(GatewayError, match="returned 1 scores for 2 endpoints"):
        sched.schedule(request(), [state(1), state(2)], now=100.0)


class SecondIsPrimary:
    """Runs every profile; the last one configured is the decision."""

    def __init__(self, tn: TypedName) -> None:
        self.typed_name = tn

    def pick_profiles(
        self,
        cycle: CycleState,
        req: LLMRequest,
        profiles: Mapping[str, ProfileRunner],
        results: Mapping[str, ProfileResult | None],
    ) -> list[str]:
        return [n for n in profiles if n not in results]

    def primary(
        self, cycle: CycleState, req: LLMRequest, results: Mapping[str, ProfileResult | None]
    ) -> str:
        return list(results)[-1]


def test_multi_profile_handler_and_post_cycle_only_for_primary() -> None:
    registry = _registry_with(
        PluginSpec(
            "second",
            PluginKind.PROFILE_HANDLER,
            NoParams,
            lambda tn, p, c: SecondIsPrimary(tn),
            "x",
        )
    )
    doc = {
        "plugins": [
            {"type": "prefix-cache-scorer"},
            {"type": "random-picker", "parameters": {"maxNumOfEndpoints": 1}},
            {"type": "second"},
        ],
        "schedulingProfiles": [
            {"name": "prefix", "plugins": [{"pluginRef": "prefix-cache-scorer"}]},
            {"name": "plain", "plugins": [{"pluginRef": "random-picker"}]},
        ],
    }
    sched = _build(doc, registry)
    result = sched.schedule(request(prompt="x" * 640), [state(1), state(2)], now=100.0)
    assert result.profile == "plain"
    assert sched.plugins["prefix-cache-scorer"].index.size == 0  # prefix profile not primary


def test_forget_endpoints_reaches_the_prefix_index() -> None:
    sched = scheduler("gie-v1-default")
    pool = [state(1), state(2)]
    picked = sched.schedule(request(prompt="y" * 640), pool, now=100.0).primary.key
    index = sched.plugins["prefix-cache-scorer"].index  # type: ignore[attr-defined, unused-ignore]
    assert index.endpoints() == [picked]
    sched.forget_endpoints(set())
    assert index.size == 0


def test_scheduler_profile_go_times_every_plugin_and_prefix_plugin_go_records_matches() -> None:
    """Upstream times each plugin call (`scheduler_profile.go`) and records the picked
    endpoint's prefix match after the pick (`prefix/plugin.go` PostCycle)."""
    sched = scheduler("default")
    prompt = "".join(f"{i:063d}|" for i in range(4))  # 4 blocks of 64 characters
    pool = [state(i) for i in range(1, 4)]
    sched.schedule(request(prompt=prompt), pool, now=100.0)
    sched.schedule(request(prompt=prompt), pool, now=100.0)
    stats = sched.stats
    points = {point for (point, _, _), _ in stats.plugins()}
    assert {"Scorer", "Picker", "PostCycle"} <= points
    for (_, type_, _), hist in stats.plugins():
        assert hist.count >= 2, type_
        assert hist.sum >= 0.0
    assert stats.prefix_hit_bytes.count == 2
    assert stats.prefix_hit_bytes.sum == 4 * 64  # the second request hit all 4 blocks
    assert stats.prefix_hit_ratio.sum == 1.0
    assert stats.prefix_index_size() == 4
