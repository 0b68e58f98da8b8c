"""The `step-phase-scorer` (opt-in): each endpoint scored by how soon a new request's prefill
would finish there, from the engines' own step clocks (`scheduling/stepclock.py`).

Cost of sending a request to an endpoint, in seconds: the time left in the step in progress
there (from the last KV-event batch's engine timestamp, the router's sends, first bytes and
ends) plus one modelled step holding everything sent and this request's uncached prefill (the
prompt less the prefix hit a `prefix-cache-scorer` named by `prefixScorer` expects, plus
`adapterTokens` where the request's LoRA adapter is not resident, as the backlog scorer counts
it: without it the scorer sent LoRA requests where their adapter was not). Score =
the lowest cost / this endpoint's: 1 for the best, 0.5 for twice as long.

Inputs: `step_ended(endpoint, ts)` for each KV-event batch (the live KV subscriber's per-batch
hook is to call it; the virtual-time benchmark calls it from the engines' step hook), and the
request lifecycle as the backlog scorer has it (PostCycle: the send; `observe_first_token`;
`request_done` with the end's time and usage, else `request_ended` without a step end).

Live (`live(exact)`, which the runtime's composition root calls when the scorer's
`prefixScorer` has `kvEvents: true`, and feeds its subscriber's batches through
`scheduling/steplive.py`): each send whose prompt's last full engine block is not yet stored
on its endpoint is watched, and the batch that stores it dates the request's first token (the
step clock's `back_date` mode: late first bytes and ends never reorder its learner). Without
exact KV events the scorer gets no batches and stays neutral (below): documented, not refused,
as a pool whose engines publish no events is a state it must take anyway.

Neutral without a clock: an endpoint with requests outstanding and no batch within `staleS`,
or whose model is not trusted yet (`requireFit`), gets the mean score of those with one (1.0
where none has one), so a pool whose engines publish no KV events is scored 1.0 everywhere and
the profile decides as without this scorer. An endpoint with nothing outstanding (that this
router knows of) is not unknown: with a trusted model it keeps its clock (an idle engine
publishes no batches; its cost is one step with the prefill, from now), without one it scores
1.0, so that a new endpoint gets requests and fits. That herds no more than one request at a
time onto a newcomer: its first send makes it outstanding (the mean again), and the queue and
running-requests scorers weigh against it meanwhile.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.kvevents import engine_block_hashes
from poolkeeper.scheduling.exact_prefix import ExactPrefixIndex
from poolkeeper.scheduling.interfaces import CycleState, ProfileResult, Scores, TypedName
from poolkeeper.scheduling.plugins.base import NamedPlugin
from poolkeeper.scheduling.plugins.prefix_scorer import PrefixCacheScorer
from poolkeeper.scheduling.plugins.shared import residency
from poolkeeper.scheduling.registry import PluginParams
from poolkeeper.scheduling.stepclock import StepClock
from poolkeeper.scheduling.types import LLMRequest


class StepPhaseParams(PluginParams):
    prefix_scorer: str = Field(
        default="",
        description="Name of a prefix-cache-scorer instance whose index gives the expected "
        "prefix hit (default empty: every prompt counts as uncached).",
    )
    prior_step_s: float = Field(
        default=0.012,
        gt=0,
        description="Prior of the step model's fixed part, s (learnt online from the step "
        "ends; the default is deliberately long, twice the simulator's 6 ms).",
    )
    prior_prefill_token_s: float = Field(
        default=90e-6, ge=0, description="Prior per prefill token, s (learnt online)."
    )
    prior_decode_s: float = Field(
        default=40e-6, ge=0, description="Prior per decoding request in a step, s (learnt)."
    )
    prior_context_token_s: float = Field(
        default=88e-9, ge=0, description="Prior per context token read in a step, s (learnt)."
    )
    adapter_tokens: int = Field(
        default=2048,
        ge=0,
        description="Prefill tokens added where the request's LoRA adapter is not resident "
        "(loading it), as the prefill-backlog-scorer's `adapterTokens`.",
    )
    stale_s: float = Field(
        default=0.5,
        gt=0,
        description="An endpoint with requests outstanding and no KV-event batch within this "
        "many seconds has no step clock and is scored neutrally (the mean of the others' "
        "scores); an idle one keeps its clock (an idle engine publishes no batches).",
    )
    require_fit: bool = Field(
        default=True,
        description="Score an endpoint only once its learnt step model holds (its counted "
        "steps agree with the requests' output tokens); until then it is scored neutrally.",
    )
    late_s: float = Field(
        default=0.002,
        ge=0,
        description="How late KV-event batches may reach the router, s: a step not reported "
        "by `now - lateS` is taken as still running.",
    )
    end_late_s: float = Field(
        default=0.02,
        ge=0,
        description="Live (KV events): how long after its last step a request's end is "
        "reported to the EPP, s; the end is back-dated by this much to count its steps.",
    )


class StepPhaseScorer(NamedPlugin):
    """Scorer + PostCycle + EndpointForgetter + first-token observer around a StepClock."""

    __slots__ = ("adapter_tokens", "clock", "exact", "prefix")
    bounded = True

    def __init__(
        self, typed_name: TypedName, params: StepPhaseParams, prefix: PrefixCacheScorer | None
    ) -> None:
        super().__init__(typed_name)
        prior = (
            params.prior_step_s,
            params.prior_prefill_token_s,
            params.prior_decode_s,
            params.prior_context_token_s,
        )
        self.clock = StepClock(
            prior,
            stale_s=params.stale_s,
            late_s=params.late_s,
            require_fit=params.require_fit,
            end_late_s=params.end_late_s,
        )
        self.prefix = prefix
        self.exact: ExactPrefixIndex | None = None  # live: the index the batches fill
        self.adapter_tokens = params.adapter_tokens

    def _cached(self, cycle: CycleState, request: LLMRequest) -> dict[str, int]:
        return {} if self.prefix is None else self.prefix.cached_tokens(cycle, request)

    def score(
        self, cycle: CycleState, request: LLMRequest, candidates: Sequence[EndpointState]
    ) -> Scores:
        now, clock = cycle.now, self.clock
        if not any(clock.fresh(s.endpoint.hostport, now) for s in candidates):
            return 1.0
        cached = self._cached(cycle, request).get
        prompt = request.prompt_tokens
        resident = residency(candidates, request.target_model, cycle)
        # The same everywhere: no adapter term (the send records the load where the picked
        # endpoint lacks it; added everywhere here, multi-LoRA 0.9x seed 1 p90 46 -> 51 ms).
        if isinstance(resident, bool):
            resident = [True] * len(candidates)
        miss = self.adapter_tokens
        keys = [s.endpoint.hostport for s in candidates]
        costs = [
            clock.prefill_done_s(k, prompt - cached(k, 0) + (0 if r else miss), prompt, now)
            for k, r in zip(keys, resident, strict=True)
        ]
        known = [c for c in costs if c is not None]
        best = max(min(known), 1e-6)
        scores = [None if c is None else best / max(c, 1e-6) for c in costs]
        mean = sum(s for s in scores if s is not None) / len(known)
        # No clock and nothing outstanding (a new endpoint, or one that publishes no events,
        # idle): as good as the best (an idle engine starts its step when the request comes);
        # with anything outstanding: the mean (unknown).
        return [
            (mean if clock.outstanding(k) else 1.0) if s is None else s
            for k, s in zip(keys, scores, strict=True)
        ]

    def post_cycle(self, cycle: CycleState, request: LLMRequest, result: ProfileResult) -> None:
        if not result.targets:
            return
        key = result.targets[0].endpoint.hostport
        cached = self._cached(cycle, request).get(key, 0)
        # The adapter's load, as the score counts it where residency differs: the engine's
        # step holds it (`residency` of the one picked).
        here = residency(result.targets[:1], request.target_model)
        extra = 0 if (here if isinstance(here, bool) else here[0]) else self.adapter_tokens
        self.clock.sent(key, request.key, request.prompt_tokens, cached, cycle.now, extra)
        exact = self.exact
        if exact is not None:  # live: the batch storing the prompt's last block dates it
            blocks = engine_block_hashes(request.target_model, request.prompt, exact.block_size)
            if blocks and key not in exact.match(blocks[-1:]):
                self.clock.watch(key, request.key, blocks[-1:])

    def live(self, exact: ExactPrefixIndex) -> None:
        """Fed live from the engines' KV events into `exact` (the composition root calls it):
        first bytes dated by the batch that stored their prompt, ends back-dated."""
        self.exact = exact
        self.clock.back_date = True

    def step_ended(self, endpoint: str, ts: float) -> None:
        """A KV-event batch from `endpoint` (ip:port), stamped `ts` by its engine (on the
        decisions' clock), applied to the exact index already when live."""
        exact = self.exact
        if exact is None:
            self.clock.step_ended(endpoint, ts)
            return
        firsts = [
            r for r, last in self.clock.watched(endpoint).items() if endpoint in exact.match(last)
        ]
        self.clock.step_ended(endpoint, ts, firsts)

    def observe_first_token(self, request_id: str, endpoint: str | None, now: float) -> None:
        self.clock.first_token(request_id, now)

    def request_done(self, request_id: str, now: float, output_tokens: int | None) -> None:
        """The request's last token came at `now` (a step end) after `output_tokens`."""
        self.clock.ended(request_id, now, output_tokens)

    def request_ended(self, request_id: str) -> None:
        self.clock.ended(request_id, None, None)  # (nothing left if `request_done` was told)

    def forget_endpoints(self, keep: set[str]) -> None:
        self.clock.forget_endpoints(keep)
