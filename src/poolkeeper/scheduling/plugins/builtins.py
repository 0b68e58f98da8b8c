"""Every built-in plugin type, registered in one place.

`builtin_registry()` returns a fresh registry; there is no shared, mutable one.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TypeVar

from poolkeeper.errors import ConfigError
from poolkeeper.scheduling.interfaces import Plugin, TypedName
from poolkeeper.scheduling.plugins.backlog_params import PrefillBacklogParams
from poolkeeper.scheduling.plugins.backlog_scorer import PrefillBacklogScorer
from poolkeeper.scheduling.plugins.cold_placement import ColdPlacementFilter
from poolkeeper.scheduling.plugins.cold_placement_params import ColdPlacementParams
from poolkeeper.scheduling.plugins.decision_tree import (
    DecisionTreeFilter,
    DecisionTreeParams,
    tree_references,
)
from poolkeeper.scheduling.plugins.filters import (
    CapacityParams,
    CriticalRequestFilter,
    DropRequestFilter,
    HasCapacityFilter,
    LeastKvCacheFilter,
    LeastQueueFilter,
    LoadParams,
    LoraAffinityFilter,
    LoraAffinityParams,
    LowQueueFilter,
    LowQueueParams,
)
from poolkeeper.scheduling.plugins.fit_scorers import (
    LoraAffinityScorer,
    LoraAffinityScorerParams,
    ObservedSpeedParams,
    ObservedSpeedScorer,
)
from poolkeeper.scheduling.plugins.missgate import GatedSaturationFilter
from poolkeeper.scheduling.plugins.pickers import (
    MaxScorePicker,
    PickerParams,
    RandomPicker,
    WeightedRandomPicker,
)
from poolkeeper.scheduling.plugins.prefix_affinity import (
    PrefixAffinityFilter,
    PrefixAffinityParams,
    PrefixHolders,
)
from poolkeeper.scheduling.plugins.prefix_params import PrefixCacheParams
from poolkeeper.scheduling.plugins.prefix_scorer import PrefixCacheScorer
from poolkeeper.scheduling.plugins.profile_handlers import SingleProfileHandler
from poolkeeper.scheduling.plugins.role_filters import (
    DecodeFilter,
    EncodeFilter,
    HeaderBasedTestingFilter,
    PrefillFilter,
)
from poolkeeper.scheduling.plugins.saturation_filter import SaturationFilter, SaturationFilterParams
from poolkeeper.scheduling.plugins.scorers import (
    InflightLoadParams,
    InflightLoadScorer,
    KvCacheScorer,
    MinMaxLoadParams,
    QueueParams,
    QueueScorer,
    RunningRequestsScorer,
)
from poolkeeper.scheduling.plugins.stale_filter import StaleMetricsFilter, StaleMetricsParams
from poolkeeper.scheduling.plugins.stepphase_scorer import StepPhaseParams, StepPhaseScorer
from poolkeeper.scheduling.plugins.ttft_scorer import PredictedTtftParams, PredictedTtftScorer
from poolkeeper.scheduling.registry import (
    BuildContext,
    NoParams,
    PluginFactory,
    PluginKind,
    PluginParams,
    PluginRegistry,
    PluginSpec,
)

F, S, P, H = PluginKind.FILTER, PluginKind.SCORER, PluginKind.PICKER, PluginKind.PROFILE_HANDLER
T = TypeVar("T", bound=PluginParams)


def _with_params(cls: Callable[[TypedName, T], Plugin], model: type[T]) -> PluginFactory:
    def factory(tn: TypedName, params: PluginParams, ctx: BuildContext) -> Plugin:
        assert isinstance(params, model)
        return cls(tn, params)

    return factory


def _with_rng(
    cls: Callable[[TypedName, T, random.Random], Plugin], model: type[T]
) -> PluginFactory:
    def factory(tn: TypedName, params: PluginParams, ctx: BuildContext) -> Plugin:
        assert isinstance(params, model)
        return cls(tn, params, ctx.rng)

    return factory


def _prefix_cache(tn: TypedName, params: PluginParams, ctx: BuildContext) -> Plugin:
    assert isinstance(params, PrefixCacheParams)
    return PrefixCacheScorer(tn, params, clock=ctx.clock)


def _stale_metrics(tn: TypedName, params: PluginParams, ctx: BuildContext) -> Plugin:
    assert isinstance(params, StaleMetricsParams)
    prefix = _prefix_scorer(tn, params.prefix_scorer, ctx)
    holders = (
        None
        if prefix is None
        else PrefixHolders(prefix, params.min_match_ratio, params.min_match_blocks)
    )
    return StaleMetricsFilter(tn, ctx.staleness_s, holders, params.holder_grace_ms / 1000.0)


def _saturation(tn: TypedName, params: PluginParams, ctx: BuildContext) -> Plugin:
    assert isinstance(params, SaturationFilterParams)
    if not params.miss_gate:
        return SaturationFilter(tn, params, ctx.staleness_s)
    if params.max_num_seqs is None and not params.learn_max_num_seqs:
        raise ConfigError(f"plugin {tn.name!r}: missGate needs maxNumSeqs or learnMaxNumSeqs")
    prefix = _prefix_scorer(tn, params.prefix_scorer, ctx)
    if prefix is None:
        raise ConfigError(f"plugin {tn.name!r}: missGate needs prefixScorer")
    return GatedSaturationFilter(tn, params, ctx.staleness_s, PrefixHolders(prefix))


def _plain(cls: Callable[[TypedName], Plugin]) -> PluginFactory:
    def factory(tn: TypedName, params: PluginParams, ctx: BuildContext) -> Plugin:
        return cls(tn)

    return factory


def _tree(tn: TypedName, params: PluginParams, ctx: BuildContext) -> Plugin:
    assert isinstance(params, DecisionTreeParams)
    return DecisionTreeFilter.build(tn, params, ctx)


def _prefix_scorer(tn: TypedName, name: str, ctx: BuildContext) -> PrefixCacheScorer | None:
    """The prefix-cache-scorer instance a plugin's `prefixScorer` names (None for "")."""
    if not name:
        return None
    prefix = ctx.resolve_plugin(name)
    if not isinstance(prefix, PrefixCacheScorer):
        raise ConfigError(f"plugin {tn.name!r}: prefixScorer {name!r} is not a prefix-cache-scorer")
    return prefix


def _predicted_ttft(tn: TypedName, params: PluginParams, ctx: BuildContext) -> Plugin:
    assert isinstance(params, PredictedTtftParams)
    return PredictedTtftScorer(tn, params, _prefix_scorer(tn, params.prefix_scorer, ctx))


def _prefill_backlog(tn: TypedName, params: PluginParams, ctx: BuildContext) -> Plugin:
    assert isinstance(params, PrefillBacklogParams)
    return PrefillBacklogScorer(tn, params, _prefix_scorer(tn, params.prefix_scorer, ctx))


def _step_phase(tn: TypedName, params: PluginParams, ctx: BuildContext) -> Plugin:
    assert isinstance(params, StepPhaseParams)
    return StepPhaseScorer(tn, params, _prefix_scorer(tn, params.prefix_scorer, ctx))


def _prefix_affinity(tn: TypedName, params: PluginParams, ctx: BuildContext) -> Plugin:
    assert isinstance(params, PrefixAffinityParams)
    prefix = _prefix_scorer(tn, params.prefix_scorer, ctx)
    return PrefixAffinityFilter(tn, params, prefix, ctx.staleness_s)


def _cold_placement(tn: TypedName, params: PluginParams, ctx: BuildContext) -> Plugin:
    assert isinstance(params, ColdPlacementParams)
    prefix = _prefix_scorer(tn, params.prefix_scorer, ctx)
    if prefix is None:
        raise ConfigError(f"plugin {tn.name!r}: cold-placement-filter needs prefixScorer")
    if params.balance and not prefix.params.kv_events:
        raise ConfigError(
            f"plugin {tn.name!r}: balance needs the prefix scorer's kvEvents: true (it counts "
            "the prefixes each engine reported)"
        )
    backlog: PrefillBacklogScorer | None = None
    if params.backlog_scorer:
        found = ctx.resolve_plugin(params.backlog_scorer)
        if not isinstance(found, PrefillBacklogScorer):
            raise ConfigError(
                f"plugin {tn.name!r}: backlogScorer {params.backlog_scorer!r} is not a "
                "prefill-backlog-scorer"
            )
        backlog = found
    return ColdPlacementFilter(tn, params, prefix, backlog)


def register_builtin_plugins(registry: PluginRegistry) -> PluginRegistry:
    """Register every built-in plugin type on `registry` (once) and return it."""
    specs = [
        # Filters
        PluginSpec("low-queue-filter", F, LowQueueParams,
                   _with_params(LowQueueFilter, LowQueueParams),
                   "Waiting queue under a threshold."),
        PluginSpec("least-queue-filter", F, LoadParams,
                   _with_params(LeastQueueFilter, LoadParams),
                   "Lowest 1/N band of waiting queues."),
        PluginSpec("least-kv-cache-filter", F, LoadParams,
                   _with_params(LeastKvCacheFilter, LoadParams),
                   "Lowest 1/N band of KV-cache utilisation."),
        PluginSpec("lora-affinity-filter", F, LoraAffinityParams,
                   _with_rng(LoraAffinityFilter, LoraAffinityParams),
                   "LoRA soft affinity (adapter loaded, else a free slot)."),
        PluginSpec("critical-request-filter", F, NoParams, _plain(CriticalRequestFilter),
                   "All endpoints iff the request is Critical (v0.3 tree)."),
        PluginSpec("has-capacity-filter", F, CapacityParams,
                   _with_params(HasCapacityFilter, CapacityParams),
                   "Queue and KV under thresholds (v0.3 gate for non-critical requests)."),
        PluginSpec("drop-request-filter", F, NoParams, _plain(DropRequestFilter),
                   "Sheds the request with 429 (v0.3 tree leaf)."),
        PluginSpec("saturation-filter", F, SaturationFilterParams,
                   _saturation,
                   "Drops stale or overloaded endpoints; fails open."),
        PluginSpec("stale-metrics-filter", F, StaleMetricsParams, _stale_metrics,
                   "Drops endpoints with stale metrics; fails open."),
        PluginSpec("decision-tree-filter", F, DecisionTreeParams, _tree,
                   "GIE v0.1-v0.5 filter tree.", filter_references=tree_references),
        PluginSpec("prefix-affinity-filter", F, PrefixAffinityParams, _prefix_affinity,
                   "The prompt's prefix holders only, while the load is balanced."),
        PluginSpec("cold-placement-filter", F, ColdPlacementParams, _cold_placement,
                   "A new long prefix to its hash-ring owner within a load band."),
        PluginSpec("decode-filter", F, NoParams, _plain(DecodeFilter),
                   "llm-d.ai/role can decode (unlabelled endpoints kept)."),
        PluginSpec("prefill-filter", F, NoParams, _plain(PrefillFilter),
                   "llm-d.ai/role can prefill."),
        PluginSpec("encode-filter", F, NoParams, _plain(EncodeFilter),
                   "llm-d.ai/role can encode."),
        PluginSpec("header-based-testing-filter", F, NoParams, _plain(HeaderBasedTestingFilter),
                   "Conformance: the endpoints test-epp-endpoint-selection lists."),
        # Scorers
        PluginSpec("queue-scorer", S, QueueParams,
                   _with_params(QueueScorer, QueueParams),
                   "Inverse min-max of the waiting queue."),
        PluginSpec("kv-cache-utilization-scorer", S, LoadParams,
                   _with_params(KvCacheScorer, LoadParams),
                   "1 - KV-cache utilisation.", aliases=("kv-cache-scorer",)),
        PluginSpec("running-requests-size-scorer", S, MinMaxLoadParams,
                   _with_params(RunningRequestsScorer, MinMaxLoadParams),
                   "Inverse min-max of running requests."),
        PluginSpec("inflight-load-scorer", S, InflightLoadParams,
                   _with_params(InflightLoadScorer, InflightLoadParams),
                   "Inverse min-max of this router's in-flight requests or tokens."),
        PluginSpec("observed-speed-scorer", S, ObservedSpeedParams,
                   _with_params(ObservedSpeedScorer, ObservedSpeedParams),
                   "Fastest observed seconds per output token / this endpoint's."),
        PluginSpec("lora-affinity-scorer", S, LoraAffinityScorerParams,
                   _with_params(LoraAffinityScorer, LoraAffinityScorerParams),
                   "1 / 0.8 / 0.6 / 0 by adapter state."),
        PluginSpec("prefix-cache-scorer", S, PrefixCacheParams,
                   _prefix_cache,
                   "Share of the prompt's leading blocks the endpoint probably caches."),
        PluginSpec("predicted-ttft-scorer", S, PredictedTtftParams, _predicted_ttft,
                   "Lowest predicted time to first token / this endpoint's (learned online)."),
        PluginSpec("prefill-backlog-scorer", S, PrefillBacklogParams, _prefill_backlog,
                   "Least prefill ahead of the first token (unanswered prompt tokens sent)."),
        PluginSpec("step-phase-scorer", S, StepPhaseParams, _step_phase,
                   "Soonest prefill end from the engines' KV-batch step clocks (opt-in)."),
        # Pickers
        PluginSpec("max-score-picker", P, PickerParams, _with_rng(MaxScorePicker, PickerParams),
                   "Highest score, random tie-break."),
        PluginSpec("random-picker", P, PickerParams, _with_rng(RandomPicker, PickerParams),
                   "Uniformly random."),
        PluginSpec("weighted-random-picker", P, PickerParams,
                   _with_rng(WeightedRandomPicker, PickerParams),
                   "Random, proportional to score."),
        # Profile handlers
        PluginSpec("single-profile-handler", H, NoParams, _plain(SingleProfileHandler),
                   "Runs the single profile."),
    ]  # fmt: skip
    for spec in specs:
        registry.register(spec)
    return registry


def builtin_registry() -> PluginRegistry:
    """A fresh registry holding every built-in plugin type."""
    return register_builtin_plugins(PluginRegistry())
