"""SchedulerProfile: filters -> weighted scorers -> picker, over one request's candidates.

Scores are clamped into [0, 1] before weighting (scorers that declare `bounded = True`, as every
built-in does, are trusted to be in range already, which the property tests check). A scorer
that returns one float for all candidates adds a constant, which never changes the ranking and
is applied once at the end.

Each plugin call is timed into the profile's `SchedulingStats` (upstream's per-plugin duration
metrics); the scheduler attaches its own, shared by all its profiles.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from time import perf_counter
from typing import Final

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
from poolkeeper.scheduling.wsum import Factor, Summers

# What a scorer returns for "the same for every candidate". A tuple, not `float | int`,
# which builds a new union object at every evaluation (each scorer of each request).
_CONSTANT = (float, int)


# A profile buckets one of its plugin timers' pending durations (`HistogramData.record`) every
# FOLD_EVERY-th run, the timers in turn, so each holds at most FOLD_EVERY x (number of timers)
# pending values (224 at 14 timers); the
# metrics endpoint's reads bucket them too. (All of them every 256th run cost that run ~1 ms at
# 1,000 endpoints, 14 timers x 256 values: a third of the decisions above the p99; one per run
# cost every decision of a small pool ~2 us, 5 % of its routing at p10.)
FOLD_EVERY: Final = 16


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
        "_filter_calls",
        "_picker_call",
        "_post_cycle_calls",
        "_runs",
        "_scorer_calls",
        "_summers",
        "_timers",
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
        self._runs = 0
        self._summers = Summers()
        self.attach_stats(SchedulingStats())

    def attach_stats(self, stats: SchedulingStats) -> None:
        """Time every plugin call into `stats` from now on."""

        def timer(point: str, plugin: Plugin) -> HistogramData:
            tn = plugin.typed_name
            return stats.plugin(point, tn.type, tn.name)

        for old in getattr(self, "_timers", ()):
            old.fold()  # what the previous stats were told stays there, bucketed
        # Per plugin, what a run calls: the bound method and its timer's `record` (an append),
        # worked out once rather than per request (attribute lookups, zips, a frame per timing).
        filters = [(f.filter, timer(FILTER, f)) for f in self.filters]
        scorers = [(w.scorer.score, timer(SCORER, w.scorer)) for w in self.scorers]
        picker = timer(PICKER, self.picker)
        post_cycles = [(p.post_cycle, timer(POST_CYCLE, p)) for p in self.post_cycles]
        self._filter_calls = tuple((call, t.record) for call, t in filters)
        self._scorer_calls = tuple(
            (call, t.record, w.weight, w.bounded, w.scorer)
            for (call, t), w in zip(scorers, self.scorers, strict=True)
        )
        self._picker_call = (self.picker.pick, picker.record)
        self._post_cycle_calls = tuple((call, t.record) for call, t in post_cycles)
        self._timers = (
            *(t for _, t in filters), *(t for _, t in scorers), picker,
            *(t for _, t in post_cycles),
        )  # fmt: skip

    def run(
        self, cycle: CycleState, request: LLMRequest, candidates: Sequence[EndpointState]
    ) -> ProfileResult | None:
        """The profile's ranked result, or None when the filters left nothing."""
        runs = self._runs = self._runs + 1
        if not runs % FOLD_EVERY:
            timers = self._timers
            timers[runs // FOLD_EVERY % len(timers)].fold()
        clock = perf_counter
        cands = candidates
        for keep, record in self._filter_calls:
            began = clock()
            cands = keep(cycle, request, cands)
            record(clock() - began)
            if not cands:
                return None
        if not self._trusted:
            allowed = {id(c) for c in candidates}
            cands = [c for c in cands if id(c) in allowed]
            if not cands:
                return None
        n = len(cands)
        # Weighted score columns (raw values and their factors), summed in one pass at the
        # end (`wsum.py`): cheaper than a running total rebuilt per scorer. Constant scores
        # fold into `offset`.
        columns: list[Sequence[float]] = []
        factors: list[Factor] = []
        tables = 0  # bit j: factors[j] is column j's table of products (small request counts)
        offset = 0.0
        for score, record, w, bounded, scorer in self._scorer_calls:
            began = clock()
            scores = score(cycle, request, cands)
            record(clock() - began)
            if isinstance(scores, _CONSTANT):
                v = float(scores)  # clamped into [0, 1] as `clamp_unit` does, inline
                offset += w * (1.0 if v >= 1.0 else v if v >= 0.0 else 0.0)
                continue
            # (an AffineScores' own length, without a call of its `__len__`)
            size = len(scores.values if isinstance(scores, AffineScores) else scores)
            if size != n:
                raise GatewayError(
                    f"scorer {scorer.typed_name} returned {size} scores for {n} endpoints"
                )
            if isinstance(scores, AffineScores):
                if bounded:
                    offset += w * scores.offset
                    factor = w * scores.scale
                    top = scores.top
                    # (a table no longer than a pass over the candidates; only built-in
                    # scorers' `top` is trusted: a wrong one would index out of the table)
                    if 0 <= top <= n and self._trusted:
                        tables |= 1 << len(columns)
                        factors.append([i * factor for i in range(top + 1)])
                    else:
                        factors.append(factor)
                    columns.append(scores.values)
                    continue
                scores = scores.materialize()
            if not bounded:
                scores = [clamp_unit(v) for v in scores]
            columns.append(scores)
            factors.append(w)
        # (an affine scorer's offset alone is not a constant ranking: its scaled values follow)
        total = self._summers.sum(columns, factors, offset, n, tables)
        pick, record = self._picker_call
        began = clock()
        picked = pick(cands, total)
        record(clock() - began)
        if not self._trusted:
            picked = [i for i in dict.fromkeys(picked) if 0 <= i < n]
        if not picked:
            return None
        return ProfileResult(
            self.name, tuple(cands[i] for i in picked), tuple(total[i] for i in picked)
        )

    def post_cycle(self, cycle: CycleState, request: LLMRequest, result: ProfileResult) -> None:
        clock = perf_counter
        for hook, record in self._post_cycle_calls:
            began = clock()
            hook(cycle, request, result)
            record(clock() - began)
