"""Built-in load scorers. Each returns scores in [0, 1] aligned with the candidates (the LoRA
and observed-speed scorers: `fit_scorers.py`).

Min-max scorers (queue, running, in-flight) score the least loaded endpoint 1 and the most
loaded 0, and return one constant 1.0 when every candidate is equal (no signal). Loads are the
effective ones (scraped + unseen in-flight, see `load.py`) unless `countUnseen` is false.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Final, Literal

from pydantic import Field

from poolkeeper.datastore.columns import MIN_CACHED, Column
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

    __slots__ = ("column", "count_unseen", "min_span")
    bounded = True

    def __init__(self, typed_name: TypedName, params: MinMaxLoadParams) -> None:
        super().__init__(typed_name)
        self.count_unseen = params.count_unseen
        self.min_span = params.min_span
        cu = self.count_unseen
        self.column = Column(lambda c: self.loads(c, cu), lambda s: self.load(s, cu))

    @staticmethod
    def loads(candidates: Sequence[EndpointState], count_unseen: bool) -> list[int]:
        """The load of each candidate, + its unseen in-flight requests when `count_unseen`."""
        raise NotImplementedError

    @staticmethod
    def load(state: EndpointState, count_unseen: bool) -> int:
        """`loads` of one candidate (the kept column's patches: `columns.py`)."""
        raise NotImplementedError

    def score(
        self, cycle: CycleState, request: LLMRequest, candidates: Sequence[EndpointState]
    ) -> Scores:
        if len(candidates) >= MIN_CACHED:
            return inverse_min_max_ints(self.column.values(cycle, candidates), self.min_span)
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
        if self.count_unseen and not self.answered_run:
            self.column = Column(_waiting_all, _waiting)

    def score(
        self, cycle: CycleState, request: LLMRequest, candidates: Sequence[EndpointState]
    ) -> Scores:
        if len(candidates) >= MIN_CACHED:
            return inverse_min_max_ints(self.column.values(cycle, candidates), self.min_span)
        if self.count_unseen and not self.answered_run:
            return inverse_min_max_ints(_waiting_all(candidates), self.min_span)
        return inverse_min_max_ints(self.loads(candidates, self.count_unseen), self.min_span)

    @staticmethod
    def loads(candidates: Sequence[EndpointState], count_unseen: bool) -> list[int]:
        if count_unseen:
            return [s.metrics.waiting + s.unseen_requests - s.unseen_answered for s in candidates]
        return [s.metrics.waiting for s in candidates]

    @staticmethod
    def load(state: EndpointState, count_unseen: bool) -> int:
        if count_unseen:
            return state.metrics.waiting + state.unseen_requests - state.unseen_answered
        return state.metrics.waiting


def _waiting_all(candidates: Sequence[EndpointState]) -> list[int]:
    """The queue with the unseen requests, answered or not (`answeredRun` false)."""
    return [s.metrics.waiting + s.unseen_requests for s in candidates]


def _waiting(state: EndpointState) -> int:
    return state.metrics.waiting + state.unseen_requests


class RunningRequestsScorer(_MinMaxLoadScorer):
    """Inverse min-max of running requests (+ unseen in-flight requests)."""

    __slots__ = ()

    @staticmethod
    def loads(candidates: Sequence[EndpointState], count_unseen: bool) -> list[int]:
        if count_unseen:
            return [s.metrics.running + s.unseen_requests for s in candidates]
        return [s.metrics.running for s in candidates]

    @staticmethod
    def load(state: EndpointState, count_unseen: bool) -> int:
        if count_unseen:
            return state.metrics.running + state.unseen_requests
        return state.metrics.running


class KvCacheScorer(NamedPlugin):
    """1 - KV-cache utilisation (+ the unseen tokens' share when capacity is known)."""

    __slots__ = ("column", "count_unseen")
    bounded = True

    def __init__(self, typed_name: TypedName, params: LoadParams) -> None:
        super().__init__(typed_name)
        self.count_unseen = params.count_unseen
        cu = self.count_unseen
        self.column = Column(lambda c: _kv_marked(c, cu), lambda s: _kv_marked_one(s, cu))

    def score(
        self, cycle: CycleState, request: LLMRequest, candidates: Sequence[EndpointState]
    ) -> Scores:
        if len(candidates) >= MIN_CACHED:
            values = self.column.values(cycle, candidates)
        else:
            values = _kv_marked(candidates, self.count_unseen)
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


def _kv_marked(candidates: Sequence[EndpointState], count_unseen: bool) -> list[float]:
    """Each candidate's utilisation (unseen tokens added where `count_unseen`), NaN where the
    scrape is broken (outside 0..1 or NaN; `effective_kv` is within 0..1 already): marked in
    the same pass, so the scorer's `sum` (NaN if any value is) finds them without a `min` and
    `max` pass, and the rare such decision clamps them all."""
    nan = _NAN
    if count_unseen:
        return [
            kv
            if 0.0 <= (kv := s.metrics.kv_cache_usage) <= 1.0 and not s.unseen_tokens
            else effective_kv(s)
            if s.unseen_tokens
            else nan
            for s in candidates
        ]
    return [kv if 0.0 <= (kv := s.metrics.kv_cache_usage) <= 1.0 else nan for s in candidates]


def _kv_marked_one(s: EndpointState, count_unseen: bool) -> float:
    """`_kv_marked` of one candidate (the kept column's patches)."""
    kv = s.metrics.kv_cache_usage
    if count_unseen and s.unseen_tokens:
        return effective_kv(s)
    return kv if 0.0 <= kv <= 1.0 else _NAN


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
