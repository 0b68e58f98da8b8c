"""SchedulerProfile: filters -> weighted scorers -> picker, over one request's candidates.

Scores are clamped into [0, 1] before weighting (scorers that declare `bounded = True`, as every
built-in does, are trusted to be in range already, which the property tests check). A scorer
that returns one float for all candidates adds a constant, which never changes the ranking and
is applied once at the end.

Each plugin call is timed into the profile's `SchedulingStats` (upstream's per-plugin duration
metrics); the scheduler attaches its own, shared by all its profiles.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import mul
from time import perf_counter

from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.errors import GatewayError
from poolkeeper.scheduling.interfaces import (
    AffineScores,
    CycleState,
    Filter,
    Picker,
    Plugin,
    PostCycle,
    ProfileResult,
    Scorer,
    is_bounded,
)
from poolkeeper.scheduling.stats import (
    FILTER,
    PICKER,
    POST_CYCLE,
    SCORER,
    HistogramData,
    SchedulingStats,
)
from poolkeeper.scheduling.types import LLMRequest

# What a scorer returns for "the same for every candidate". A tuple, not `float | int`,
# which builds a new union object at every evaluation (each scorer of each request).
_CONSTANT = (float, int)


def clamp_unit(v: float) -> float:
    """v clamped into [0, 1]; NaN -> 0."""
    if v >= 1.0:
        return 1.0
    if v >= 0.0:
        return v
    return 0.0  # negative or NaN


@dataclass(frozen=True, slots=True)
class WeightedScorer:
    scorer: Scorer
    weight: float
    bounded: bool


def _is_builtin(plugin: object) -> bool:
    return type(plugin).__module__.startswith("poolkeeper.scheduling.plugins.")


class SchedulerProfile:
    """One named profile. Built by `build.build_scheduler`."""

    __slots__ = (
        "_filter_timers",
        "_picker_timer",
        "_post_cycle_timers",
        "_scorer_timers",
        "_trusted",
        "filters",
        "name",
        "picker",
        "post_cycles",
        "scorers",
    )

    def __init__(
        self,
        name: str,
        filters: Sequence[Filter],
        scorers: Sequence[tuple[Scorer, float]],
        picker: Picker,
    ) -> None:
        self.name = name
        self.filters = tuple(filters)
        self.scorers = tuple(WeightedScorer(s, w, is_bounded(s)) for s, w in scorers if w != 0)
        self.picker = picker
        members: list[Plugin] = [*self.filters, *(w.scorer for w in self.scorers), picker]
        self.post_cycles = tuple(p for p in members if isinstance(p, PostCycle))
        # Built-in filters only return subsets of their input and built-in pickers only valid
        # indices; anything else gets its output checked, so a decision can only ever name
        # one of the request's candidates.
        self._trusted = all(_is_builtin(p) for p in members)
        self.attach_stats(SchedulingStats())

    def attach_stats(self, stats: SchedulingStats) -> None:
        """Time every plugin call into `stats` from now on."""

        def timer(point: str, plugin: Plugin) -> HistogramData:
            tn = plugin.typed_name
            return stats.plugin(point, tn.type, tn.name)

        self._filter_timers = tuple(timer(FILTER, f) for f in self.filters)
        self._scorer_timers = tuple(timer(SCORER, w.scorer) for w in self.scorers)
        self._picker_timer = timer(PICKER, self.picker)
        self._post_cycle_timers = tuple(timer(POST_CYCLE, p) for p in self.post_cycles)

    def run(
        self, cycle: CycleState, request: LLMRequest, candidates: Sequence[EndpointState]
    ) -> ProfileResult | None:
        """The profile's ranked result, or None when the filters left nothing."""
        clock = perf_counter
        cands = candidates
        for f, timer in zip(self.filters, self._filter_timers, strict=True):
            began = clock()
            cands = f.filter(cycle, request, cands)
            timer.observe(clock() - began)
            if not cands:
                return None
        if not self._trusted:
            allowed = {id(c) for c in candidates}
            cands = [c for c in cands if id(c) in allowed]
            if not cands:
                return None
        n = len(cands)
        # Weighted score columns, summed in one C-level pass at the end (zip + sum): cheaper
        # than a running total rebuilt per scorer. Constant scores fold into `offset`.
        parts: list[Iterable[float]] = []
        offset = 0.0
        for ws, timer in zip(self.scorers, self._scorer_timers, strict=True):
            began = clock()
            scores = ws.scorer.score(cycle, request, cands)
            timer.observe(clock() - began)
            w = ws.weight
            if isinstance(scores, _CONSTANT):
                offset += w * clamp_unit(float(scores))
                continue
            if len(scores) != n:
                raise GatewayError(
                    f"scorer {ws.scorer.typed_name} returned {len(scores)} scores for {n} endpoints"
                )
            if isinstance(scores, AffineScores):
                if ws.bounded:
                    offset += w * scores.offset
                    factor = w * scores.scale
                    parts.append(map(mul, scores.values, repeat(factor)))
                    continue
                scores = scores.materialize()
            if not ws.bounded:
                scores = [clamp_unit(v) for v in scores]
            parts.append(scores if w == 1.0 else map(mul, scores, repeat(w)))
        if offset:
            parts.append(repeat(offset, n))
        # (an affine scorer's offset alone is not a constant ranking: its scaled values follow)
        if not parts:
            total = [0.0] * n
        elif len(parts) == 1:
            total = list(parts[0])
        else:
            total = list(map(sum, zip(*parts, strict=True)))
        began = clock()
        picked = self.picker.pick(cands, total)
        self._picker_timer.observe(clock() - began)
        if not self._trusted:
            picked = [i for i in dict.fromkeys(picked) if 0 <= i < n]
        if not picked:
            return None
        return ProfileResult(
            self.name, tuple(cands[i] for i in picked), tuple(total[i] for i in picked)
        )

    def post_cycle(self, cycle: CycleState, request: LLMRequest, result: ProfileResult) -> None:
        for hook, timer in zip(self.post_cycles, self._post_cycle_timers, strict=True):
            began = perf_counter()
            hook.post_cycle(cycle, request, result)
            timer.observe(perf_counter() - began)
