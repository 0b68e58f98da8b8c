"""Built-in scorers of how well an endpoint suits a request beyond its load: the LoRA adapter it
has resident (`lora-affinity-scorer`), its observed speed (`observed-speed-scorer`). Each returns
scores in [0, 1] aligned with the candidates; the load scorers are in `scorers.py`.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from poolkeeper.datastore.columns import MIN_CACHED, Column, Columns
from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.scheduling.interfaces import CycleState, Scores, TypedName
from poolkeeper.scheduling.plugins.base import NamedPlugin
from poolkeeper.scheduling.plugins.shared import (
    residency,
    residency_columns,
    speed_bar,
    speed_column,
)
from poolkeeper.scheduling.registry import PluginParams
from poolkeeper.scheduling.types import LLMRequest


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

    __slots__ = ("kept", "params", "resident")
    bounded = True

    def __init__(self, typed_name: TypedName, params: LoraAffinityScorerParams) -> None:
        super().__init__(typed_name)
        self.params = params
        self.resident: Columns[bool] = residency_columns()
        # Per target model: each candidate's score (`_lora_score`), kept between decisions.
        self.kept: Columns[float] = Columns(
            lambda model: Column(lambda c: self._all(c, model), lambda s: self._one(s, model))
        )

    def _all(self, candidates: Sequence[EndpointState], model: str) -> list[float]:
        """`_one` of each candidate, as one comprehension (a call per candidate costs 3-4x)."""
        p = self.params
        active, free, waiting = p.active_score, p.free_slot_score, p.waiting_score
        return [
            active
            if model == m.served_model or model in m.active_adapters
            else free
            if m.max_adapters and len(m.active_adapters) + len(m.waiting_adapters) < m.max_adapters
            else waiting
            if model in m.waiting_adapters
            else 0.0
            for s in candidates
            for m in [s.metrics]
        ]

    def _one(self, s: EndpointState, model: str) -> float:
        """One candidate's score for `model` (the kept columns' values; the comprehensions
        of `score` inline the same rule)."""
        p = self.params
        m = s.metrics
        if model == m.served_model or model in m.active_adapters:
            return p.active_score
        if m.max_adapters and len(m.active_adapters) + len(m.waiting_adapters) < m.max_adapters:
            return p.free_slot_score
        return p.waiting_score if model in m.waiting_adapters else 0.0

    def score(
        self, cycle: CycleState, request: LLMRequest, candidates: Sequence[EndpointState]
    ) -> Scores:
        p = self.params
        model = request.target_model
        active, free, waiting = p.active_score, p.free_slot_score, p.waiting_score
        resident = residency(candidates, model, cycle, self.resident)
        if resident is True:
            return active
        if len(candidates) >= MIN_CACHED:
            out = self.kept.of(model).values(cycle, candidates)
            return out[0] if out.count(out[0]) == len(out) else out
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

    __slots__ = ("kept", "slack")
    bounded = True

    def __init__(self, typed_name: TypedName, params: ObservedSpeedParams) -> None:
        super().__init__(typed_name)
        self.slack = 1.0 + params.tolerance
        self.kept = speed_column()

    def score(
        self, cycle: CycleState, request: LLMRequest, candidates: Sequence[EndpointState]
    ) -> Scores:
        found = speed_bar(candidates, self.slack, cycle, self.kept)
        if found is None:
            return 1.0
        values, bar = found
        return [1.0 if v <= bar else bar / v for v in values]
