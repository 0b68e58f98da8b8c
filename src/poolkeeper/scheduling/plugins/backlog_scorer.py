"""The `prefill-backlog-scorer`: each endpoint scored by the prefill a request would wait behind.

Cost of sending a request to an endpoint, in prompt tokens: the endpoint's prefill backlog
(`scheduling/backlog.py`: uncached prompt tokens this router sent there whose first byte has
not come back) plus the request's own uncached tokens there (prompt tokens minus the expected
prefix hit, read from a `prefix-cache-scorer` named by `prefixScorer`, so one index serves
both), plus `baseTokens` for the step every first token waits for anyway, plus `adapterTokens`
where the request's LoRA adapter is not resident; on an endpoint the router measured as
slower per output token than `1 + speedTolerance` times the fastest, scaled by how much
slower. Score = the lowest cost / this endpoint's: 1 for the best, 0.5 for twice the prefill
ahead.

The options measured as candidates for the default (`drainRate`, `marginal`, `busyPenalty`,
`spanTokens`, `meanSpan`, the fade): `backlog_params.py`, with why none was adopted.

Why: a continuous-batching engine gives a request its first token at the end of the step that
finishes its prefill, and prefills queued or running there come first or share the step. The
waiting count the queue scorer reads lags by a scrape and weighs a 4,000-token prompt like a
40-token one; the router knows both the tokens and, from the first byte, when each prefill was
over. In the virtual fleet this signal alone (`ref-pending-prefill`, docs/benchmarks.md) took
identical servers from level with round-robin to 0.89-0.93x of its p90 TTFT.

Learning nothing, it needs the first-byte events: the scheduler's `observe_first_token` (the
Director at the first response byte; the virtual-time benchmark at the simulated first token)
ends an entry, and `request_ended` ends it for a request that produced none. A request whose
first byte is never reported (a non-streamed response) counts until it ends. Entries are keyed
by the send (`LLMRequest.key`, the Director's `id#seq`), not the client's id, which may repeat.

`sync` (a `SendTap`, `backlog_params.py`; None unless cross-replica sync is bound:
`scheduling/replicasync/fold.py`) is told of each of this EPP's own sends, first bytes and ends
as the backlog records them, so the other replicas can count them too.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from operator import attrgetter
from typing import Final

from poolkeeper.datastore.columns import MIN_CACHED, Column, Positions
from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.scheduling.backlog import BUSY_WINDOW_S, PrefillBacklog
from poolkeeper.scheduling.interfaces import CycleState, ProfileResult, Scores, TypedName
from poolkeeper.scheduling.plugins.backlog_params import PrefillBacklogParams, SendTap
from poolkeeper.scheduling.plugins.base import NamedPlugin
from poolkeeper.scheduling.plugins.prefix_scorer import PrefixCacheScorer
from poolkeeper.scheduling.plugins.shared import (
    adapter_floor,
    residency,
    residency_columns,
    slowed,
    speed_column,
)
from poolkeeper.scheduling.types import LLMRequest

_HOSTPORT: Final = attrgetter("endpoint.hostport")


class PrefillBacklogScorer(NamedPlugin):
    """Scorer + PostCycle + EndpointForgetter + first-token observer around a PrefillBacklog."""

    __slots__ = (
        "_busy_at", "_busy_share", "_keys", "_positions", "_resident", "_speeds",
        "adapter_tokens", "backlog", "base_tokens",
        "busy_penalty", "drain_rate", "fade_from", "fade_rise_s", "fade_to", "marginal",
        "mean_span", "prefix", "slack", "span_tokens", "sync",
    )  # fmt: skip
    bounded = True

    def __init__(
        self,
        typed_name: TypedName,
        params: PrefillBacklogParams,
        prefix: PrefixCacheScorer | None = None,
    ) -> None:
        super().__init__(typed_name)
        self.backlog = PrefillBacklog(work_tokens=params.base_tokens)
        self.base_tokens = params.base_tokens
        self.drain_rate = params.drain_rate
        self.span_tokens = params.span_tokens
        self.mean_span = params.mean_span
        self.busy_penalty = params.busy_penalty
        self.marginal = params.marginal
        self.adapter_tokens = params.adapter_tokens
        tolerance = params.speed_tolerance
        self.slack = None if tolerance is None else 1.0 + tolerance
        # Kept between decisions (`columns.py`): residency, speeds, each candidate's ip:port.
        self._resident = residency_columns()
        self._speeds = speed_column()
        self._positions = Positions()
        self._keys: Column[str] = Column(
            lambda c: [s.endpoint.hostport for s in c], lambda s: s.endpoint.hostport
        )
        self.prefix = prefix
        self.fade_from = params.fade_from
        self.fade_to = max(params.fade_to, (params.fade_from or 0.0) + 1e-6)
        self.fade_rise_s = params.fade_rise_s or BUSY_WINDOW_S
        self._busy_share = 0.0
        self._busy_at: float | None = None
        self.sync: SendTap | None = None

    def _cached_tokens(self, cycle: CycleState, request: LLMRequest) -> dict[str, int]:
        """ip:port -> prompt tokens the endpoint probably caches (the prefix scorer's match,
        once per decision: scoring and PostCycle read the same)."""
        prefix = self.prefix
        return {} if prefix is None else prefix.cached_tokens(cycle, request)

    def costs(
        self, cycle: CycleState, request: LLMRequest, candidates: Sequence[EndpointState]
    ) -> list[float]:
        """The prefill (tokens, at the fastest endpoint's speed) a request would wait for on
        each candidate, in order (ints where no speed term applies: exact token sums)."""
        own = request.prompt_tokens + self.base_tokens
        target, miss = request.target_model, self.adapter_tokens
        cached = self._cached_tokens(cycle, request)
        backlog = self.backlog.snapshot()
        # One comprehension over the candidates for the whole sum (residency, then the
        # backlog less the prefix hit, read from one map) rather than one pass per term: at
        # 1,000 candidates each pass cost 30-60 us, each lookup per candidate 25 us. In
        # integers: every term is a token count, so the sums are exact in any order (far below
        # 2**53) and the floats made of them later are the same, but int and float mixed in
        # one operation take the interpreter's slow path (10 % of this pass).
        extra = backlog
        if cached:  # the few endpoints that hold a prefix: their hit off their backlog
            extra = dict(backlog)
            for k, h in cached.items():
                extra[k] = extra.get(k, 0) - h
        more = extra.get
        costs: list[float]  # (of ints, until a rate or a speed divides them)
        # Residency read once per decision (the LoRA scorer reads the same): often the same
        # for every candidate, and then one base cost for all.
        resident = residency(candidates, target, cycle, self._resident) if miss else True
        many = len(candidates) >= MIN_CACHED
        if many and isinstance(resident, bool) and (at := self._positions.of(cycle, candidates)):
            # One base cost, and the endpoints with a backlog or a hit written over it (the
            # same sums: `base + 0` is `base`), rather than a lookup per candidate.
            base = own if resident else own + miss
            costs = [base] * len(candidates)
            for k, v in extra.items():
                if (i := at.get(k)) is not None:
                    costs[i] = base + v
        else:
            # (each candidate's ip:port kept between decisions where there are many; else
            # read in C as the comprehension goes)
            keys: Iterable[str] = (
                self._keys.values(cycle, candidates) if many else map(_HOSTPORT, candidates)
            )
            if isinstance(resident, bool):
                base = own if resident else own + miss
                costs = [base + more(k, 0) for k in keys]
            else:
                dear = own + miss
                costs = [
                    (own if r else dear) + more(k, 0) for r, k in zip(resident, keys, strict=True)
                ]
        # The optional terms: marginal queue, drain rates, busy, speed (inline: a call less
        # per decision, which a small pool notices).
        if self.marginal and backlog:
            waiting, tokens, hit = self.backlog.counts().get, request.prompt_tokens, cached.get
            costs = [
                c + waiting(k := s.endpoint.hostport, 0) * max(0, tokens - hit(k, 0))
                for c, s in zip(costs, candidates, strict=True)
            ]
        if self.drain_rate:
            costs = self._drained(costs, candidates)
        if self.busy_penalty:
            busy, now = self.backlog.utilisation, cycle.now
            costs = [
                c / (1.0 - min(0.9, busy(s.endpoint.hostport, now)))
                for c, s in zip(costs, candidates, strict=True)
            ]
        if self.slack is not None:
            return slowed(costs, candidates, self.slack, cycle, self._speeds)
        return costs

    def _drained(self, costs: list[float], candidates: Sequence[EndpointState]) -> list[float]:
        """Costs over each endpoint's measured drain rate (unmeasured: the fastest's)."""
        rates = self.backlog.rates()
        if not rates:
            return costs
        fastest = max(rates.values())
        rate = rates.get
        return [
            c / rate(s.endpoint.hostport, fastest) for c, s in zip(costs, candidates, strict=True)
        ]

    def busy_share(self, now: float, candidates: int) -> float:
        """Time-averaged share of the pool's endpoints with a backlog (time constant
        `BUSY_WINDOW_S`; `fadeRiseS` while it rises), sampled at each decision: how close the
        pool is to saturation."""
        now_share = min(1.0, len(self.backlog.counts()) / max(1, candidates))
        at = self._busy_at
        if at is None:
            self._busy_share = now_share
        elif now > at:
            window = self.fade_rise_s if now_share > self._busy_share else BUSY_WINDOW_S
            keep = math.exp(-(now - at) / window)
            self._busy_share = self._busy_share * keep + now_share * (1.0 - keep)
        if at is None or now > at:
            self._busy_at = now
        return self._busy_share

    def score(
        self, cycle: CycleState, request: LLMRequest, candidates: Sequence[EndpointState]
    ) -> Scores:
        if self.fade_from is None:
            return self._score(cycle, request, candidates, 1.0)
        share = self.busy_share(cycle.now, len(candidates))
        say = (self.fade_to - share) / (self.fade_to - self.fade_from)
        if say <= 0.0:
            return self._adapter_floor(cycle, request, candidates)
        return self._score(cycle, request, candidates, min(say, 1.0))

    def _adapter_floor(
        self, cycle: CycleState, request: LLMRequest, candidates: Sequence[EndpointState]
    ) -> list[float] | float:
        """What the fade leaves: the adapter term alone (`shared.adapter_floor`). In a LoRA
        pool requests starved of an adapter slot keep the busy share at 1; fading the adapter
        term with the backlog sent requests where their adapter was not, starving more
        (docs/notes/2026-12-07-lora-replicas-cliff.md)."""
        if not self.adapter_tokens:
            return 1.0
        resident = residency(candidates, request.target_model, cycle, self._resident)
        own = request.prompt_tokens + self.base_tokens
        return adapter_floor(resident, own, self.adapter_tokens)

    def _score(
        self,
        cycle: CycleState,
        request: LLMRequest,
        candidates: Sequence[EndpointState],
        say: float,
    ) -> list[float] | float:
        """The scores faded to `say` (1: in full): `1 - say + say x score`."""
        costs = self.costs(cycle, request, candidates)
        best = min(costs)
        keep = 1.0 - say
        # All equal only if the first is the lowest: mostly decided without a `max` pass.
        if costs[0] == best and best == max(costs):
            if say >= 1.0:
                return 1.0
            floor = self._adapter_floor(cycle, request, candidates)  # (a tie, not the adapter)
            return floor if isinstance(floor, float) else [keep * f + say for f in floor]
        if self.mean_span:
            backlog = self.backlog.snapshot()
            ahead = backlog.get
            mean = sum(ahead(s.endpoint.hostport, 0) for s in candidates) / len(candidates)
            if self.drain_rate and (rates := self.backlog.rates()):
                mean /= max(rates.values())
            span = best + mean
        elif self.span_tokens is None:
            # The ratio rule, faded in the same pass (the same operations as a second one).
            if say >= 1.0:
                return [best / c for c in costs]
            floor = self._adapter_floor(cycle, request, candidates)
            if isinstance(floor, list):
                return [keep * f + say * (best / c) for f, c in zip(floor, costs, strict=True)]
            return [keep + say * (best / c) for c in costs]
        else:
            span = float(self.span_tokens)
            if self.drain_rate:
                rates = self.backlog.rates()
                if rates:
                    span /= max(rates.values())
        if say >= 1.0:
            return [span / (span + c - best) for c in costs]
        floor = self._adapter_floor(cycle, request, candidates)
        if isinstance(floor, list):
            pairs = zip(floor, costs, strict=True)
            return [keep * f + say * (span / (span + c - best)) for f, c in pairs]
        return [keep + say * (span / (span + c - best)) for c in costs]

    def post_cycle(self, cycle: CycleState, request: LLMRequest, result: ProfileResult) -> None:
        if not result.targets:
            return
        key = result.targets[0].endpoint.hostport
        # The request's own uncached tokens there, as matched at the decision (before the
        # prefix scorer's PostCycle records this prompt).
        cached = self._cached_tokens(cycle, request)
        tokens = request.prompt_tokens - cached.get(key, 0)
        self.backlog.sent(request.key, key, tokens, cycle.now, seen=request.stream)
        if self.sync is not None:
            self.sync.sent(cycle, request, key, tokens)

    def observe_first_token(self, request_id: str, endpoint: str | None, now: float) -> None:
        self.backlog.first_token(request_id, now)
        # Told whether or not the backlog still counted it: it may have dropped the entry (its
        # cap, the forgetter) after the send was told; the tap knows what it told.
        if self.sync is not None:
            self.sync.answered(request_id)

    def request_ended(self, request_id: str) -> None:
        self.backlog.ended(request_id)
        if self.sync is not None:
            self.sync.ended(request_id)

    def forget_endpoints(self, keep: set[str]) -> None:
        self.backlog.forget_endpoints(keep)
