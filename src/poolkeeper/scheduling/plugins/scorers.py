"""Built-in load and LoRA scorers. Each returns scores in [0, 1] aligned with the candidates.

Min-max scorers (queue, running, in-flight) score the least loaded endpoint 1 and the most
loaded 0, and return one constant 1.0 when every candidate is equal (no signal). Loads are the
effective ones (scraped + unseen in-flight, see `load.py`) unless `countUnseen` is false.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Final, Literal, TypeVar

from pydantic import Field

from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.datastore.load import effective_kv
from poolkeeper.scheduling.interfaces import AffineScores, CycleState, Scores, TypedName
from poolkeeper.scheduling.plugins.base import NamedPlugin
from poolkeeper.scheduling.plugins.filters import LoadParams
from poolkeeper.scheduling.registry import PluginParams
from poolkeeper.scheduling.types import LLMRequest


def inverse_min_max(values: list[int] | list[float], min_span: float = 0.0) -> Scores:
    """1 - (v - min) / max(max - min, min_span) per value; 1.0 for all when they are equal.

    With `min_span` 0 this is GIE's min-max normalisation, where a difference of one request
    spans the whole [0, 1] range. A positive `min_span` makes small differences cost
    proportionally less, so another scorer (prefix affinity) can outweigh them until the load
    is really skewed. Returned in affine form (no pass of its own over the values).
    """
    lo, hi = min(values), max(values)
    return _inverse_span(values, lo, hi, min_span)


def inverse_min_max_ints(values: list[int], min_span: float = 0.0) -> Scores:
    """`inverse_min_max` of request counts: their bounds read off the distinct values (a few
    dozen at most; a set of them costs less than `min` and `max` of the list each)."""
    distinct = set(values)
    lo, hi = min(distinct), max(distinct)
    scores = _inverse_span(values, lo, hi, min_span)
    if isinstance(scores, AffineScores) and lo >= 0:
        # Every value is an int in 0..hi: the profile may read its weighted products from a
        # table of hi + 1 (`wsum.Summers`; bit-identical: the same int x float products).
        return replace(scores, top=hi)
    return scores


def _inverse_span(values: list[int] | list[float], lo: float, hi: float, min_span: float) -> Scores:
    if hi == lo:
        return 1.0
    span = hi - lo
    if span < min_span:
        span = min_span
    return AffineScores(values, -1.0 / span, 1.0 + lo / span)


class MinMaxLoadParams(LoadParams):
    min_span: float = Field(
        default=0,
        ge=0,
        description="Smallest load range (requests) mapped onto the full [0, 1] score range "
        "(default 0 = plain min-max, as upstream).",
    )


class _MinMaxLoadScorer(NamedPlugin):
    """Inverse min-max of a per-endpoint load; subclasses say which load (`loads`)."""

    __slots__ = ("count_unseen", "min_span")
    bounded = True

    def __init__(self, typed_name: TypedName, params: MinMaxLoadParams) -> None:
        super().__init__(typed_name)
        self.count_unseen = params.count_unseen
        self.min_span = params.min_span

    @staticmethod
    def loads(candidates: Sequence[EndpointState], count_unseen: bool) -> list[int]:
        """The load of each candidate, + its unseen in-flight requests when `count_unseen`."""
        raise NotImplementedError

    def score(
        self, cycle: CycleState, request: LLMRequest, candidates: Sequence[EndpointState]
    ) -> Scores:
        return inverse_min_max_ints(self.loads(candidates, self.count_unseen), self.min_span)


# The subclasses' `loads` are list comprehensions reading the field inline: at 1,000 endpoints
# a getter call per endpoint (operator.attrgetter, load.effective_*) costs two to three times
# as much.


class QueueParams(MinMaxLoadParams):
    answered_run: bool = Field(
        default=True,
        description="Count unseen requests whose first byte came back as running, not "
        "waiting (default true; only a profile that learns first bytes knows them).",
    )


class QueueScorer(_MinMaxLoadScorer):
    """Inverse min-max of the waiting queue (+ unseen in-flight requests, less those that
    already answered unless `answeredRun` is false)."""

    __slots__ = ("answered_run",)

    def __init__(self, typed_name: TypedName, params: MinMaxLoadParams) -> None:
        super().__init__(typed_name, params)
        self.answered_run = params.answered_run if isinstance(params, QueueParams) else True

    def score(
        self, cycle: CycleState, request: LLMRequest, candidates: Sequence[EndpointState]
    ) -> Scores:
        if self.count_unseen and not self.answered_run:
            loads = [s.metrics.waiting + s.unseen_requests for s in candidates]
            return inverse_min_max_ints(loads, self.min_span)
        return inverse_min_max_ints(self.loads(candidates, self.count_unseen), self.min_span)

    @staticmethod
    def loads(candidates: Sequence[EndpointState], count_unseen: bool) -> list[int]:
        if count_unseen:
            return [s.metrics.waiting + s.unseen_requests - s.unseen_answered for s in candidates]
        return [s.metrics.waiting for s in candidates]


class RunningRequestsScorer(_MinMaxLoadScorer):
    """Inverse min-max of running requests (+ unseen in-flight requests)."""

    __slots__ = ()

    @staticmethod
    def loads(candidates: Sequence[EndpointState], count_unseen: bool) -> list[int]:
        if count_unseen:
            return [s.metrics.running + s.unseen_requests for s in candidates]
        return [s.metrics.running for s in candidates]


class KvCacheScorer(NamedPlugin):
    """1 - KV-cache utilisation (+ the unseen tokens' share when capacity is known)."""

    __slots__ = ("count_unseen",)
    bounded = True

    def __init__(self, typed_name: TypedName, params: LoadParams) -> None:
        super().__init__(typed_name)
        self.count_unseen = params.count_unseen

    def score(
        self, cycle: CycleState, request: LLMRequest, candidates: Sequence[EndpointState]
    ) -> Scores:
        # A scraped value outside 0..1 or NaN (a broken exporter) is marked NaN in the same
        # pass (`effective_kv` is within 0..1 already), so the sum (NaN if any value is) finds
        # them without a `min` and `max` pass; the rare such decision clamps them all.
        nan = _NAN
        if self.count_unseen:
            values = [
                kv
                if 0.0 <= (kv := s.metrics.kv_cache_usage) <= 1.0 and not s.unseen_tokens
                else effective_kv(s)
                if s.unseen_tokens
                else nan
                for s in candidates
            ]
        else:
            values = [
                kv if 0.0 <= (kv := s.metrics.kv_cache_usage) <= 1.0 else nan for s in candidates
            ]
        total = sum(values)
        if total != total:
            values = [_unit(v) for v in self._raw(candidates)]
        return AffineScores(values, -1.0, 1.0)

    def _raw(self, candidates: Sequence[EndpointState]) -> list[float]:
        """Each candidate's utilisation, unclamped where scraped (unseen tokens added)."""
        if self.count_unseen:
            return [
                s.metrics.kv_cache_usage if not s.unseen_tokens else effective_kv(s)
                for s in candidates
            ]
        return [s.metrics.kv_cache_usage for s in candidates]


_NAN: Final = math.nan


def _unit(x: float) -> float:
    """x clamped into [0, 1]; NaN (unknown utilisation) counts as full."""
    return 0.0 if x <= 0.0 else x if x < 1.0 else 1.0


class InflightLoadParams(PluginParams):
    unit: Literal["requests", "tokens"] = Field(
        default="requests",
        description="Count router-side in-flight requests or their tokens (default requests).",
    )


class InflightLoadScorer(NamedPlugin):
    """Inverse min-max of this router's own in-flight load per endpoint (all of it, seen or
    not). Works without any scraped metric, so it keeps spreading load when scrapes fail."""

    __slots__ = ("tokens",)
    bounded = True

    def __init__(self, typed_name: TypedName, params: InflightLoadParams) -> None:
        super().__init__(typed_name)
        self.tokens = params.unit == "tokens"

    def score(
        self, cycle: CycleState, request: LLMRequest, candidates: Sequence[EndpointState]
    ) -> Scores:
        if self.tokens:
            return inverse_min_max([s.inflight_tokens for s in candidates])  # (mostly distinct)
        return inverse_min_max_ints([s.inflight_requests for s in candidates])


class LoraAffinityScorerParams(PluginParams):
    active_score: float = Field(
        default=1.0, ge=0, le=1, description="Adapter active (default 1.0)."
    )
    free_slot_score: float = Field(
        default=0.8, ge=0, le=1, description="Adapter absent but a slot is free (default 0.8)."
    )
    waiting_score: float = Field(
        default=0.6, ge=0, le=1, description="Adapter only waiting for a slot (default 0.6)."
    )


class LoraAffinityScorer(NamedPlugin):
    """1.0 if the target adapter is active; 0.8 if it could load without eviction
    (active + waiting < max); 0.6 if it is already waiting; else 0 (GIE v1 values).

    Deliberately unlike upstream: a request for the endpoint's own base model (its
    `served_model`, the scraped `model_name` label) scores 1.0 like an active adapter, because
    the base model is always resident. Upstream scores it as an absent adapter (0.8 with a
    free slot, else 0), which herds all base-model traffic onto whichever server has no
    adapters loaded. Where no endpoint reports a served model the GIE values apply unchanged;
    in a pool without LoRA whose engines report no model every endpoint scores 0 (no effect).
    """

    __slots__ = ("params",)
    bounded = True

    def __init__(self, typed_name: TypedName, params: LoraAffinityScorerParams) -> None:
        super().__init__(typed_name)
        self.params = params

    def score(
        self, cycle: CycleState, request: LLMRequest, candidates: Sequence[EndpointState]
    ) -> Scores:
        p = self.params
        model = request.target_model
        active, free, waiting = p.active_score, p.free_slot_score, p.waiting_score
        resident = residency(candidates, model, cycle)
        if resident is True:
            return active
        # One conditional expression per endpoint (no appends): this runs for every candidate.
        if resident is False:
            out = [
                free
                if m.max_adapters
                and len(m.active_adapters) + len(m.waiting_adapters) < m.max_adapters
                else waiting
                if model in m.waiting_adapters
                else 0.0
                for s in candidates
                for m in [s.metrics]  # (an assignment, not a loop: no list is built)
            ]
        else:
            out = [
                active
                if r
                else free
                if m.max_adapters
                and len(m.active_adapters) + len(m.waiting_adapters) < m.max_adapters
                else waiting
                if model in m.waiting_adapters
                else 0.0
                for r, s in zip(resident, candidates, strict=True)
                for m in [s.metrics]
            ]
        # Often uniform (a base-model request, or no LoRA in the pool): one value then saves
        # the profile a pass over the candidates.
        return out[0] if out and out.count(out[0]) == len(out) else out


def residency(
    candidates: Sequence[EndpointState], target: str, cycle: CycleState | None = None
) -> list[bool] | bool:
    """Whether `target` (a request's model) is resident on each candidate: the candidate's
    served base model or one of its active LoRA adapters; one bool when the same for all (a
    pool without LoRA, or one that runs the adapter nowhere). The one rule of "resident"
    (`lora-affinity-scorer`'s active score, the prefill-backlog scorer's adapter term). With
    `cycle`, worked out once per decision for the same candidates and target (read-only)."""
    return _per_decision(cycle, _RESIDENCY, candidates, target, _residency)


def _residency(candidates: Sequence[EndpointState], target: str) -> list[bool] | bool:
    flags = [
        target == (m := s.metrics).served_model or target in m.active_adapters for s in candidates
    ]
    return flags[0] if flags and flags.count(flags[0]) == len(flags) else flags


def speed_bar(
    candidates: Sequence[EndpointState], slack: float, cycle: CycleState | None = None
) -> tuple[list[float], float] | None:
    """Each candidate's observed seconds per output token (0.0 where not observed yet) and the
    bar `slack` x the fastest observed one: slower than the bar is slow. None when no candidate
    was observed. The one rule of "slower than the fastest" (`observed-speed-scorer`, the
    prefill-backlog scorer's speed term). With `cycle`, worked out once per decision for the
    same candidates and slack (both scorers of the default profile ask; read-only result)."""
    return _per_decision(cycle, _SPEED_BAR, candidates, slack, _speed_bar)


# The cycle state's keys of `speed_bar`'s and `residency`'s (candidates, count, argument,
# result): module paths, which no plugin instance's name (the keys plugins use) can be.
_SPEED_BAR: Final = f"{__name__}.speed_bar"
_RESIDENCY: Final = f"{__name__}.residency"

_A = TypeVar("_A")
_R = TypeVar("_R")


def _per_decision(
    cycle: CycleState | None,
    key: str,
    candidates: Sequence[EndpointState],
    arg: _A,
    work: Callable[[Sequence[EndpointState], _A], _R],
) -> _R:
    """`work(candidates, arg)`, kept in `cycle` under `key` for the rest of the decision."""
    if cycle is None:
        return work(candidates, arg)
    done = cycle.get(key)
    # The same list object and length: a filter that reorders or trims a list in place
    # between two profiles would otherwise be handed the other's result.
    if (
        isinstance(done, tuple)
        and done[0] is candidates
        and done[1] == len(candidates)
        and done[2] == arg
    ):
        return done[3]  # type: ignore[no-any-return]
    found = work(candidates, arg)
    cycle.put(key, (candidates, len(candidates), arg, found))
    return found


def _speed_bar(
    candidates: Sequence[EndpointState], slack: float
) -> tuple[list[float], float] | None:
    values = [s.seconds_per_output_token for s in candidates]
    try:
        fastest = min(values)  # type: ignore[type-var]  # the common case: all observed
    except TypeError:  # some endpoint not observed yet (None)
        if values.count(None) == len(values):
            return None  # none observed (a new pool): no pass over the values
        fastest = None
    if fastest is None or fastest <= 0.0:
        known = [v for v in values if v is not None and v > 0.0]
        if not known:
            return None
        fastest = min(known)
        values = [0.0 if v is None else v for v in values]  # unobserved: counts as fast
    return values, fastest * slack  # type: ignore[return-value]  # None replaced above


class ObservedSpeedParams(PluginParams):
    tolerance: float = Field(
        default=0.0,
        ge=0,
        description="Slowdown treated as noise: endpoints within (1 + tolerance) x the fastest "
        "observed seconds per token score 1 (default 0).",
    )


class ObservedSpeedScorer(NamedPlugin):
    """Relative observed speed: (1 + tolerance) x the fastest endpoint's seconds per output
    token divided by this endpoint's (`EndpointState.seconds_per_output_token`, measured by
    the router), capped at 1; with tolerance 0 the fastest scores 1 and one twice as slow 0.5.
    An endpoint not yet observed scores 1, so new or idle servers get tried; with no
    observation at all every endpoint scores 1 (no effect).
    """

    __slots__ = ("slack",)
    bounded = True

    def __init__(self, typed_name: TypedName, params: ObservedSpeedParams) -> None:
        super().__init__(typed_name)
        self.slack = 1.0 + params.tolerance

    def score(
        self, cycle: CycleState, request: LLMRequest, candidates: Sequence[EndpointState]
    ) -> Scores:
        found = speed_bar(candidates, self.slack, cycle)
        if found is None:
            return 1.0
        values, bar = found
        return [1.0 if v <= bar else bar / v for v in values]
