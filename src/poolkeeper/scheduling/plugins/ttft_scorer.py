"""The `predicted-ttft-scorer`: each endpoint scored by the time to first token it would give.

Owns a `TtftModel` (scheduling/ttft.py). For every candidate it predicts the request's TTFT from
the prefill it would need there (prompt tokens minus the expected prefix hit, read from a
`prefix-cache-scorer` instance named by `prefixScorer`, so one index serves both), the queue
ahead of it (scraped waiting requests, prompt tokens sent since the scrape), the running batch,
KV use and whether the target adapter is resident. Score = the lowest prediction / this
endpoint's (1 for the best, 0.5 for twice as slow).

Learning: PostCycle remembers the picked endpoint's features; the scheduler's
`observe_first_token` (the Director at the first response byte of a streamed request, the
virtual-time benchmark at the simulated first token) turns them into a sample, and
`request_ended` forgets requests that produced none. Until `minSamples` samples were seen the
scorer returns one constant (no effect), so the profile's other scorers decide meanwhile.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.datastore.load import effective_kv
from poolkeeper.scheduling.interfaces import CycleState, ProfileResult, Scores, TypedName
from poolkeeper.scheduling.plugins.base import NamedPlugin
from poolkeeper.scheduling.plugins.prefix_scorer import PrefixCacheScorer
from poolkeeper.scheduling.registry import PluginParams
from poolkeeper.scheduling.ttft import TtftModel
from poolkeeper.scheduling.types import LLMRequest


class PredictedTtftParams(PluginParams):
    prefix_scorer: str = Field(
        default="",
        description="Name of a prefix-cache-scorer instance whose index gives the expected "
        "prefix hit (default empty: every prompt counts as uncached).",
    )
    min_samples: int = Field(
        default=50, ge=1, description="Observed first tokens before the scorer has an effect."
    )
    forgetting: float = Field(
        default=0.999,
        ge=0.9,
        le=1.0,
        description="Weight the fit keeps of the past per sample (default 0.999).",
    )


class PredictedTtftScorer(NamedPlugin):
    """Scorer + PostCycle + EndpointForgetter + first-token observer around one TtftModel."""

    __slots__ = ("model", "prefix")
    bounded = True

    def __init__(
        self,
        typed_name: TypedName,
        params: PredictedTtftParams,
        prefix: PrefixCacheScorer | None = None,
    ) -> None:
        super().__init__(typed_name)
        self.model = TtftModel(min_samples=params.min_samples, forgetting=params.forgetting)
        self.prefix = prefix

    def _cached_chars(self, cycle: CycleState, request: LLMRequest) -> tuple[dict[str, int], int]:
        """ip:port -> matched prompt characters, and the prompt's length in characters."""
        if self.prefix is None or not request.prompt:
            return {}, len(request.prompt)
        return self.prefix.matched(cycle, request), len(request.prompt)

    def features(
        self, request: LLMRequest, state: EndpointState, cached_chars: int, prompt_chars: int
    ) -> tuple[float, ...]:
        """The model's inputs (`ttft.FEATURES`) for sending `request` to `state`."""
        m = state.metrics
        tokens = request.prompt_tokens
        share = min(1.0, cached_chars / prompt_chars) if prompt_chars else 0.0
        kv = effective_kv(state, count_unseen=False)  # unseen tokens are their own feature
        target = request.target_model
        resident = target == m.served_model or target in m.active_adapters
        return (
            1.0,
            tokens * (1.0 - share) / 1000.0,
            float(m.waiting),
            state.unseen_tokens / 1000.0,
            m.running / 100.0,
            kv,
            0.0 if resident else 1.0,
        )

    def predictions(
        self, cycle: CycleState, request: LLMRequest, candidates: Sequence[EndpointState]
    ) -> list[float]:
        """Predicted TTFT (s) per candidate, in order, at least 1 ms: `w . features(...)`
        with the per-request parts folded into constants, one pass over the candidates (at
        1,000 endpoints a tuple and a dot product per candidate would double the cost)."""
        cached, chars = self._cached_chars(cycle, request)
        get = cached.get
        w0, w1, w2, w3, w4, w5, w6 = self.model.w
        own = w1 * request.prompt_tokens / 1000.0  # the whole prompt's prefill term
        per_char = own / chars if chars else 0.0
        w3, w4 = w3 / 1000.0, w4 / 100.0
        target = request.target_model
        out: list[float] = []
        append = out.append
        for s in candidates:
            m = s.metrics
            hit = get(s.endpoint.hostport, 0)
            kv = m.kv_cache_usage
            if not 0.0 < kv < 1.0:  # load.effective_kv's rule, inlined: NaN (unknown) is full
                kv = 0.0 if kv <= 0.0 else 1.0
            p = (
                w0
                + (own - per_char * hit if hit < chars else 0.0)
                + w2 * m.waiting
                + w3 * s.unseen_tokens
                + w4 * m.running
                + w5 * kv
            )
            if target != m.served_model and target not in m.active_adapters:
                p += w6
            append(p if p > 1e-3 else 1e-3)
        return out

    def score(
        self, cycle: CycleState, request: LLMRequest, candidates: Sequence[EndpointState]
    ) -> Scores:
        if not self.model.ready:
            # Match now, before the prefix scorer's PostCycle records this prompt, so the
            # features remembered for learning see the cache as it was at the decision.
            self._cached_chars(cycle, request)
            return 1.0
        preds = self.predictions(cycle, request, candidates)
        best = min(preds)
        return [best / p for p in preds]

    def post_cycle(self, cycle: CycleState, request: LLMRequest, result: ProfileResult) -> None:
        if not result.targets:
            return
        picked = result.targets[0]
        key = picked.endpoint.hostport
        cached, chars = self._cached_chars(cycle, request)
        x = self.features(request, picked, cached.get(key, 0), chars)
        self.model.remember(request.key, key, cycle.now, x)

    def observe_first_token(self, request_id: str, endpoint: str | None, now: float) -> None:
        self.model.observe(request_id, now, endpoint=endpoint)

    def request_ended(self, request_id: str) -> None:
        self.model.drop(request_id)

    def forget_endpoints(self, keep: set[str]) -> None:
        self.model.forget_endpoints(keep)
