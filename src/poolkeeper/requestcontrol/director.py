"""The Director: one incoming request in, one routing decision (or one GatewayError) out.

    body -> InferenceModel by modelName -> target model by weight -> criticality
         (v1.x: InferenceModelRewrite rule -> target model; InferenceObjective -> priority)
         -> candidates (pool endpoints, subset hint, in-flight load) -> the gate (now, wait in
         flow control's queue, or 429) -> scheduler
         -> destination endpoints + rewritten body; in-flight accounting until `complete`.

One path: the gate (`ports.Gate`) decides whether and when, with flow control on
(`FlowGate`: queue by band and flow) or off (`ShedGate`: admit or shed at once); the Director
does not know which.

Transport-independent: the ext_proc server calls `route` once the body is complete and
`complete` once the response has ended (or the stream was cancelled). Everything raised out of
`route` is a GatewayError whose HTTP status is the answer to send (400, 404, 413, 429, 503, 500).

What it makes of a request before the gate (target model, band, the scheduler's request) is
`prepare.py`, where the decisions are listed; which pool and endpoints, `candidates.py`; what
it keeps of each send until the response ends, `sends.py` (the Director's base); the
decision sent back (body rewrite, ticket), `decision.py`.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable

from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.errors import (
    GatewayError,
    ModelNotFound,
    NoReadyEndpoint,
    PayloadTooLarge,
    QueueFull,
)
from poolkeeper.flowcontrol.flowitem import FlowItem
from poolkeeper.requestcontrol.body import parse_body, quote_model
from poolkeeper.requestcontrol.candidates import destinations, pool_candidates, unknown_model_pool
from poolkeeper.requestcontrol.config import RequestHandling, TrustedHeader
from poolkeeper.requestcontrol.decision import bodyless_decision, routing_decision
from poolkeeper.requestcontrol.flowgate import FlowGate
from poolkeeper.requestcontrol.ports import (
    Gate,
    InflightLike,
    Job,
    LearningSchedulerLike,
    PeerLoadLike,
    PrefillFactsLike,
    SchedulerLike,
    SnapshotSource,
    SnapshotView,
)
from poolkeeper.requestcontrol.prepare import (
    Prepared,
    band,
    cached_question,
    prefill_question,
    scheduler_request,
    target_model,
    trusted,
)
from poolkeeper.requestcontrol.sends import Sends
from poolkeeper.requestcontrol.types import IncomingRequest, RoutingDecision
from poolkeeper.scheduling.types import LLMRequest

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
log = logging.getLogger(__name__)


class Director(Sends):
    """Turns IncomingRequests into RoutingDecisions; see the module docstring."""

    def __init__(
        self,
        *,
        datastore: SnapshotSource,
        scheduler: SchedulerLike,
        inflight: InflightLike,
        gate: Gate,
        config: RequestHandling,
        rng: random.Random,
        clock: Callable[[], float] = time.monotonic,
        responses_observed: bool = False,
        prefill_facts: PrefillFactsLike | None = None,
    ) -> None:
        # Told about first bytes and ends only when some plugin learns from them.
        learner = (
            scheduler
            if isinstance(scheduler, LearningSchedulerLike) and scheduler.observes_first_tokens
            else None
        )
        # The scheduler's facts flow control asks before dispatch, and only what its config
        # reads: `holdNewPrefixes` the held request's prefill question (and the gate's
        # wake-up on a first byte: a prefill backlog fell, held requests ask again), a band's
        # `avoidPrefillUnlessCached` the prefix match. Nothing else is built per request.
        self._facts = prefill_facts if isinstance(gate, FlowGate) else None
        flow = gate.config if isinstance(gate, FlowGate) else None
        holds = self._facts is not None and flow is not None and flow.hold_new_prefixes is not None
        self._asks_prefill = holds
        self._asks_cached = self._facts is not None and flow is not None and flow.prefix_aware
        super().__init__(
            inflight=inflight,
            gate=gate,
            learner=learner,
            wake=gate.wake if holds and isinstance(gate, FlowGate) else None,
            clock=clock,
        )
        self._datastore = datastore
        self._responses_observed = responses_observed
        self._scheduler = scheduler
        self._config = config
        # Each control header's spellings the operator trusts, llm-d's first: looked up on
        # every request, so worked out once.
        allowed = set(config.trusted_headers)
        self._trusted_names = {
            header: tuple(name.value for name in header.spellings() if name in allowed)
            for header in TrustedHeader
        }
        self._rng = rng
        # The peers' sends since each endpoint's scrape, set by the runtime while sync folds
        # them (`peerUnseen`): added to the candidates' unseen counts after our own.
        self.peers: PeerLoadLike | None = None
        self.peer_errors = 0  # `peers.apply` raised: the request went on without them

    @property
    def gate(self) -> Gate:
        return self._gate

    @property
    def flow(self) -> FlowGate | None:
        """The gate when it queues (flow control on; its gauges and metrics hook), else None."""
        return self._gate if isinstance(self._gate, FlowGate) else None

    @property
    def config(self) -> RequestHandling:
        return self._config

    @property
    def scheduler(self) -> SchedulerLike:
        return self._scheduler

    # --- request path ---------------------------------------------------------------------

    async def route(self, request: IncomingRequest) -> RoutingDecision:
        """Decide where `request` goes, waiting in flow control's queue if it must (the
        ext_proc stream stays open meanwhile). Raises GatewayError (its http_status is the
        answer); cancelling the call takes a waiting request out of the queue at once."""
        result = self._guarded(request)
        if isinstance(result, RoutingDecision):
            return result
        try:
            return await self._gate.wait(result)
        except GatewayError as exc:
            exc.model, exc.target_model = result.payload.model, result.payload.target
            raise

    def route_now(self, request: IncomingRequest) -> RoutingDecision:
        """`route` without the coroutine (synchronous callers): a request that would have to
        wait in the flow-control queue is refused with 429 queue_full instead."""
        result = self._guarded(request)
        if isinstance(result, RoutingDecision):
            return result
        self._gate.withdraw(result)
        raise QueueFull("the request would have to wait and this caller cannot")

    def _guarded(self, request: IncomingRequest) -> RoutingDecision | FlowItem[Job]:
        try:
            return self._route(request)
        except GatewayError:
            raise
        except Exception as exc:  # a bug below us must still become a clean 500
            log.exception("internal error routing request %s", request.request_id)
            raise GatewayError("internal error while routing the request") from exc

    def _route(self, request: IncomingRequest) -> RoutingDecision | FlowItem[Job]:
        limit = self._config.max_body_bytes
        if len(request.body) > limit:
            raise PayloadTooLarge(f"request body is larger than {limit} bytes")
        snapshot = self._datastore.snapshot()
        if not request.body and request.method.upper() not in _BODY_METHODS:
            # An empty POST is not bodyless: it gets the body checks (400), never a random pod.
            return bodyless_decision(
                request.request_id, snapshot, self._config, self._subset(request),
                rng=self._rng, key=self._send_key(request), now=self._clock(),
            )  # fmt: skip

        parsed = parse_body(request.path, request.body)
        found = snapshot.resolve(parsed.model)
        if found is not None:
            pool_key, model = found
        elif (unknown := unknown_model_pool(snapshot, self._config)) is None:
            raise ModelNotFound(f"model {quote_model(parsed.model)} not found", model=parsed.model)
        else:
            pool_key, model = unknown, None
        names = self._trusted_names
        target = target_model(
            request, snapshot, pool_key, parsed.model, model, self._rng, self.observer,
            names[TrustedHeader.MODEL_NAME_REWRITE],
        )  # fmt: skip
        criticality, priority = band(
            request, snapshot, pool_key, model, found is None,
            names[TrustedHeader.INFERENCE_OBJECTIVE], self._config.unknown_model_policy,
        )  # fmt: skip
        prepared = Prepared(request, parsed, pool_key, target, criticality, priority)
        try:
            return self._submit(prepared, snapshot)
        except GatewayError as exc:
            # The front end labels its error metrics with these; it must not parse again.
            exc.model, exc.target_model = parsed.model, target
            raise

    def _submit(
        self, prepared: Prepared, snapshot: SnapshotView
    ) -> RoutingDecision | FlowItem[Job]:
        """Hand the request to the gate: it goes now, waits, or is refused (429)."""
        request, parsed, pool_key = prepared.request, prepared.parsed, prepared.pool_key
        # The fairness key: the modelName, or the operator-trusted fairness-id header.
        flow = trusted(request, self._trusted_names[TrustedHeader.FAIRNESS_ID]) or parsed.model
        subset = self._subset(request)
        # Built once: the scheduler's request, and (`holdNewPrefixes`) the held request's.
        llm_request = scheduler_request(prepared, subset, self._send_key(request))
        # 503 now when nothing could ever serve it; the gate's first look reuses this read.
        first = [pool_candidates(snapshot, pool_key, subset)]

        def states() -> list[EndpointState]:
            raw = (
                first.pop()
                if first
                else pool_candidates(self._datastore.snapshot(), pool_key, subset)
            )
            return self._load(raw)

        def run(candidates: list[EndpointState] | None, now: float | None) -> RoutingDecision:
            if candidates is None:
                # Late binding: the snapshot and load of the moment of dispatch.
                fresh = self._datastore.snapshot()
                candidates = self._load(pool_candidates(fresh, pool_key, subset))
            return self._schedule(prepared, llm_request, candidates, flow=flow, now=now)

        job = Job(
            request.request_id, pool_key, parsed.model, prepared.target, prepared.criticality,
            flow, parsed.prompt_tokens, len(request.body), states, run, self._abandon,
            priority=prepared.priority or 0, max_tokens=parsed.max_tokens,
        )  # fmt: skip
        if self._asks_prefill:
            job.prefill = prefill_question(self._facts, self._clock, llm_request)
        if self._asks_cached:
            job.cached = cached_question(self._facts, self._clock, llm_request)
        try:
            return self._gate.submit(job)
        finally:
            first.clear()  # a request that waits re-reads the pool when the pump asks

    def _schedule(
        self,
        prepared: Prepared,
        llm_request: LLMRequest,
        candidates: list[EndpointState],
        *,
        flow: str,
        now: float | None,
    ) -> RoutingDecision:
        if now is None:
            now = self._clock()
        result = self._scheduler.schedule(llm_request, candidates, now=now)
        endpoints = destinations(result, candidates, self._config.fallback_endpoints)
        if not endpoints:
            learner = self._learner
            if learner is not None:  # PostCycle counted the send: no ticket will end it
                learner.request_ended(llm_request.key)
            raise NoReadyEndpoint(f"no endpoint of pool {prepared.pool_key} can take the request")
        tokens, target = prepared.parsed.prompt_tokens, prepared.target
        self._inflight.start(llm_request.key, endpoints[0], tokens, now, target)
        return routing_decision(
            prepared, llm_request.key, candidates, endpoints, now=now, flow=flow,
            config=self._config, responses_observed=self._responses_observed,
        )  # fmt: skip

    def _load(self, states: list[EndpointState]) -> list[EndpointState]:
        """The candidates with this replica's in-flight load, and its peers' unseen sends when
        sync folds them (`peers`)."""
        loaded = self._inflight.apply(states)
        peers = self.peers
        if peers is None:
            return loaded
        try:
            return peers.apply(loaded)
        except Exception:  # a hint only: never fails a request; our own load is still right
            self.peer_errors += 1
            if self.peer_errors & (self.peer_errors - 1) == 0:  # the 1st, 2nd, 4th, 8th...
                log.exception("peers' unseen sends left out (%d times so far)", self.peer_errors)
            return loaded

    def _subset(self, request: IncomingRequest) -> frozenset[str] | None:
        if request.subset_hint is None or not self._config.honor_subset_hint:
            return None
        return frozenset(request.subset_hint)

    def model_names(self) -> list[str]:
        """Every client-facing modelName, sorted (for GET /v1/models)."""
        return list(self._datastore.snapshot().model_names())

    def ready(self) -> bool:
        """Resources are loaded and the last scrape of at least one endpoint succeeded."""
        snapshot = self._datastore.snapshot()
        return any(s.metrics.reachable for k in snapshot.pool_keys() for s in snapshot.states(k))
