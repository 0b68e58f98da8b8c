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

Decisions (see docs/configuration.md, "Request handling"):
- Which InferenceModel a modelName means is the datastore's answer (`DatastoreSnapshot.resolve`,
  `datastore/models.py`): oldest wins, within a pool and across pools.
- Target model, first that applies: the InferenceModel's targetModels split; the pool's
  InferenceModelRewrite rule for the name (exact, else generic); the trusted
  `x-gateway-model-name-rewrite` header; the name itself.
- Band: the InferenceObjective named by a trusted `x-gateway-inference-objective` header (in
  the request's pool; priority > 0 Critical, 0 Standard, < 0 Sheddable), else the
  InferenceModel's criticality, else Standard at priority 0 (a rewrite-routed name, policy
  Passthrough) or Sheddable (policy PassthroughSheddable). Unknown objective names are
  ignored, as upstream does (priority 0).
- Bodyless requests (e.g. GET /v1/models) go to a random endpoint of the default pool
  (`requestHandling.defaultPool`, else the only pool, else the first pool by key); no model
  lookup, no gate, no in-flight accounting.
- The subset hint comes from proxy metadata, never from client headers; entries match endpoints
  by IP (upstream behaviour). Client `x-gateway-*` headers are dropped before the scheduler sees
  the request, so no plugin can be steered by them.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from poolkeeper.api.criticality import (
    Criticality,
    criticality_of_priority,
    effective_criticality,
)
from poolkeeper.api.model import InferenceModel
from poolkeeper.api.objective import DEFAULT_PRIORITY
from poolkeeper.api.pool import V1 as POOL_V1
from poolkeeper.backend.engines import names_responses_itself
from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.errors import (
    GatewayError,
    ModelNotFound,
    NoReadyEndpoint,
    PayloadTooLarge,
    QueueFull,
)
from poolkeeper.flowcontrol.flowitem import FlowItem
from poolkeeper.hostport import host_of
from poolkeeper.requestcontrol.body import ParsedRequest, parse_body, quote_model
from poolkeeper.requestcontrol.config import RequestHandling, TrustedHeader, UnknownModelPolicy
from poolkeeper.requestcontrol.flowgate import FlowGate
from poolkeeper.requestcontrol.ports import (
    Gate,
    InflightLike,
    Job,
    LearningSchedulerLike,
    PrefillFactsLike,
    SchedulerLike,
    SnapshotSource,
    SnapshotView,
)
from poolkeeper.requestcontrol.rewrite import rewrite_body, should_inject_usage
from poolkeeper.requestcontrol.split import choose_rewrite_target, choose_target_model
from poolkeeper.requestcontrol.types import (
    IncomingRequest,
    RoutingDecision,
    Usage,
    model_renamed,
)
from poolkeeper.scheduling.types import LLMRequest, SchedulingResult

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
log = logging.getLogger(__name__)

_CONTROL_HEADER_PREFIX = "x-gateway-"
_CONTROL_NAME_START = "\n" + _CONTROL_HEADER_PREFIX


def _names_responses_itself(candidates: Sequence[EndpointState], endpoints: Sequence[str]) -> bool:
    """Whether any server the request may go to (pick or fallback) names its responses after
    itself, whatever the request's model (llama.cpp)."""
    chosen = set(endpoints)
    return any(names_responses_itself(s.endpoint.engine) for s in candidates if s.key in chosen)


# --- bookkeeping -------------------------------------------------------------------------------


class DirectorObserver(Protocol):
    """Metrics hooks on the Director's own events (telemetry implements them)."""

    def first_token(self, decision: RoutingDecision, seconds: float) -> None:
        """A successful response's first body byte, `seconds` after the request was sent to
        its endpoint."""
        ...

    def model_rewritten(self, rewrite: str, model: str, target: str) -> None:
        """An InferenceModelRewrite rule (`namespace/name`) chose `target` for `model`."""
        ...


@dataclass(slots=True)
class Ticket:
    """The Director's handle on one routed request (RoutingDecision.ticket).

    `key` identifies the request in the in-flight tracker. It is the request id plus a
    Director-wide sequence number: request ids come from clients (`x-request-id`) and may
    repeat, and two live requests must never share (and so end) each other's accounting.
    """

    key: str
    endpoint: str  # where the in-flight accounting currently sits ("" = not tracked)
    tokens: int
    started_at: float
    flow: str = ""  # the gate's flow to charge the answer to ("" = none: bodyless)
    band: Criticality = Criticality.STANDARD
    done: bool = False
    model: str | None = None  # the target model it was counted for (in-flight per model)


@dataclass(slots=True)
class Prepared:
    """A request once the Director knows what it is: parsed, resolved and split, banded. What
    scheduling it needs, now or (after waiting in flow control) later. Read-only by
    convention (not `frozen`: its `__init__` would cost 2-3x, per request)."""

    request: IncomingRequest
    parsed: ParsedRequest
    pool_key: str
    target: str  # the model sent to the server
    criticality: Criticality
    priority: int | None  # the objective's priority, when one decided the band


class Director:
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
        self._datastore = datastore
        # With the response observer, a response whose model name needs no rewrite never
        # passes the EPP, so nothing could strip a usage chunk injected into it.
        self._responses_observed = responses_observed
        self._scheduler = scheduler
        # Told about first bytes and ends only when some plugin learns from them.
        self._learner = (
            scheduler
            if isinstance(scheduler, LearningSchedulerLike) and scheduler.observes_first_tokens
            else None
        )
        self._inflight = inflight
        self._gate = gate
        # The scheduler's facts flow control asks before dispatch, and only what its config
        # reads: `holdNewPrefixes` the held request's prefill question (and the gate's
        # wake-up on a first byte: a prefill backlog fell, held requests ask again), a band's
        # `avoidPrefillUnlessCached` the prefix match. Nothing else is built per request.
        self._facts = prefill_facts if isinstance(gate, FlowGate) else None
        flow = gate.config if isinstance(gate, FlowGate) else None
        holds = self._facts is not None and flow is not None and flow.hold_new_prefixes is not None
        self._asks_prefill = holds
        self._asks_cached = self._facts is not None and flow is not None and flow.prefix_aware
        self._wake = gate.wake if holds and isinstance(gate, FlowGate) else None
        self._config = config
        # Each control header's spellings the operator trusts, llm-d's first: looked up on
        # every request, so worked out once.
        trusted = set(config.trusted_headers)
        self._trusted_names = {
            header: tuple(name.value for name in header.spellings() if name in trusted)
            for header in TrustedHeader
        }
        self._rng = rng
        self._clock = clock
        self._sequence = itertools.count()
        self.observer: DirectorObserver | None = None  # set by the runtime (metrics)

    @property
    def gate(self) -> Gate:
        return self._gate

    @property
    def flow(self) -> FlowGate | None:
        """The gate when it queues (flow control on; its gauges and metrics hook), else None."""
        return self._gate if isinstance(self._gate, FlowGate) else None

    @property
    def wants_first_tokens_at_once(self) -> bool:
        """Whether first tokens should be reported as they happen (`server/envoy_bootstrap.py`'s
        bootstrap): the scheduler learns from them, or flow control's `holdNewPrefixes`
        asks its held requests again on each (a prefill ended). Reported only at the
        request's end, a held request would wait for completions instead."""
        return self._learner is not None or self._wake is not None

    def _abandon(self, decision: RoutingDecision) -> None:
        self.complete(decision, status=None, usage=None)

    @property
    def config(self) -> RequestHandling:
        return self._config

    @property
    def scheduler(self) -> SchedulerLike:
        return self._scheduler

    @property
    def inflight(self) -> InflightLike:
        return self._inflight

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
            return self._route_bodyless(request, snapshot)

        parsed = parse_body(request.path, request.body)
        found = snapshot.resolve(parsed.model)
        if found is not None:
            pool_key, model = found
        elif (unknown := self._unknown_model_pool(snapshot)) is None:
            raise ModelNotFound(f"model {quote_model(parsed.model)} not found", model=parsed.model)
        else:
            pool_key, model = unknown, None
        target = self._target(request, snapshot, pool_key, parsed.model, model)
        criticality, priority = self._band(request, snapshot, pool_key, model, found is None)
        prepared = Prepared(request, parsed, pool_key, target, criticality, priority)
        try:
            return self._submit(prepared, snapshot)
        except GatewayError as exc:
            # The front end labels its error metrics with these; it must not parse again.
            exc.model, exc.target_model = parsed.model, target
            raise

    def _unknown_model_pool(self, snapshot: SnapshotView) -> str | None:
        """The pool a model no resource names goes to, or None to refuse it (404).

        `unknownModelPolicy` unset follows the default pool's API generation: an
        `inference.networking.k8s.io/v1` pool passes any model through (upstream v1.x and
        llm-d-router have no model list), the x-k8s generations keep their 404."""
        policy = self._config.unknown_model_policy
        if policy is UnknownModelPolicy.REJECT:
            return None
        if policy is not None:
            return self._default_pool(snapshot)
        try:
            pool_key = self._default_pool(snapshot)
        except NoReadyEndpoint:
            return None
        pool = snapshot.pool(pool_key)
        return pool_key if pool is not None and pool.api_version == POOL_V1 else None

    def _trusted(self, request: IncomingRequest, header: TrustedHeader) -> str | None:
        """A control header's value in either spelling (the llm-d one first), only where the
        operator trusts that spelling (else None)."""
        for name in self._trusted_names[header]:
            value = request.headers.get(name, "").strip()
            if value:
                return value
        return None

    def _target(
        self,
        request: IncomingRequest,
        snapshot: SnapshotView,
        pool_key: str,
        name: str,
        model: InferenceModel | None,
    ) -> str:
        """The model sent to the server (see the module docstring for the order)."""
        if model is not None and model.spec.target_models:
            return choose_target_model(model, self._rng)
        rule = snapshot.rewrite_rule(pool_key, name)
        if rule is not None:
            target = choose_rewrite_target(rule, self._rng)
            if self.observer is not None:
                self.observer.model_rewritten(rule.rewrite, name, target)
            return target
        return self._trusted(request, TrustedHeader.MODEL_NAME_REWRITE) or name

    def _band(
        self,
        request: IncomingRequest,
        snapshot: SnapshotView,
        pool_key: str,
        model: InferenceModel | None,
        passthrough: bool,
    ) -> tuple[Criticality, int | None]:
        """(criticality band, objective priority or None) of the request."""
        wanted = self._trusted(request, TrustedHeader.INFERENCE_OBJECTIVE)
        objective = snapshot.objective(pool_key, wanted) if wanted is not None else None
        if objective is not None:
            return objective.criticality, objective.priority
        if model is not None:
            return effective_criticality(model.spec.criticality), None
        if passthrough and self._config.unknown_model_policy is (
            UnknownModelPolicy.PASSTHROUGH_SHEDDABLE
        ):
            return Criticality.SHEDDABLE, None
        return criticality_of_priority(DEFAULT_PRIORITY), DEFAULT_PRIORITY

    def _submit(
        self, prepared: Prepared, snapshot: SnapshotView
    ) -> RoutingDecision | FlowItem[Job]:
        """Hand the request to the gate: it goes now, waits, or is refused (429)."""
        request, parsed, pool_key = prepared.request, prepared.parsed, prepared.pool_key
        # The fairness key: the modelName, or the operator-trusted fairness-id header.
        flow = self._trusted(request, TrustedHeader.FAIRNESS_ID) or parsed.model
        subset = self._subset(request)
        # Built once: the scheduler's request, and (`holdNewPrefixes`) the held request's.
        llm_request = self._llm_request(prepared, subset, self._send_key(request))
        # 503 now when nothing could ever serve it; the gate's first look reuses this read.
        first = [self._candidates(snapshot, pool_key, subset)]

        def states() -> list[EndpointState]:
            raw = (
                first.pop()
                if first
                else self._candidates(self._datastore.snapshot(), pool_key, subset)
            )
            return self._inflight.apply(raw)

        def run(candidates: list[EndpointState] | None, now: float | None) -> RoutingDecision:
            if candidates is None:
                # Late binding: the snapshot and load of the moment of dispatch.
                fresh = self._datastore.snapshot()
                candidates = self._inflight.apply(self._candidates(fresh, pool_key, subset))
            return self._schedule(prepared, llm_request, candidates, flow=flow, now=now)

        job = Job(
            request.request_id, pool_key, parsed.model, prepared.target, prepared.criticality,
            flow, parsed.prompt_tokens, len(request.body), states, run, self._abandon,
            priority=prepared.priority or 0, max_tokens=parsed.max_tokens,
        )  # fmt: skip
        if self._asks_prefill:
            job.prefill = self._prefill_question(llm_request)
        if self._asks_cached:
            job.cached = self._cached_question(llm_request)
        try:
            return self._gate.submit(job)
        finally:
            first.clear()  # a request that waits re-reads the pool when the pump asks

    def _prefill_question(
        self, llm_request: LLMRequest
    ) -> Callable[[list[EndpointState]], tuple[Callable[[], int], list[int]]]:
        """`Job.prefill`: the scheduler's two facts for `holdNewPrefixes`, asked afresh each
        time (the prefix index and the backlogs move while the request is held); the prefix
        match only when the backlogs call for it (`PrefixHold.holds`)."""
        facts = self._facts
        assert facts is not None

        def uncached() -> int:
            try:
                return facts.uncached_tokens(llm_request, self._clock())
            except Exception:  # a bug in a plugin must not hold (or kill the pump): let it go
                log.exception("internal error asking whether to hold %s", llm_request.request_id)
                return 0

        def ask(candidates: list[EndpointState]) -> tuple[Callable[[], int], list[int]]:
            return uncached, facts.backlogs(candidates)

        return ask

    def _cached_question(self, llm_request: LLMRequest) -> Callable[[], dict[str, int]]:
        """`Job.cached`: the request's prefix match per endpoint, asked afresh each time (a
        band's `avoidPrefillUnlessCached`)."""
        facts = self._facts
        assert facts is not None

        def cached() -> dict[str, int]:
            try:
                return facts.cached_tokens(llm_request, self._clock())
            except Exception:  # a bug in a plugin must not kill the pump: avoid as without it
                rid = llm_request.request_id
                log.exception("internal error reading the prefix match of %s", rid)
                return {}

        return cached

    def _send_key(self, request: IncomingRequest) -> str:
        """This send's identity: the client's id (clients choose it, so two live sends may
        carry one) and the Director's sequence. The in-flight tracker, the learners (the
        backlog, its cross-replica sync) and the ticket all key by it, end to end."""
        return f"{request.request_id}#{next(self._sequence)}"

    def _llm_request(
        self, prepared: Prepared, subset: frozenset[str] | None, key: str
    ) -> LLMRequest:
        """The request as the scheduler sees it (`subset`: `_subset`'s for it; `key`:
        `_send_key`'s)."""
        request, parsed = prepared.request, prepared.parsed
        return LLMRequest(
            request_id=request.request_id,
            model=parsed.model,
            target_model=prepared.target,
            criticality=prepared.criticality,
            priority=prepared.priority,
            prompt=parsed.prompt,
            prompt_tokens=parsed.prompt_tokens,
            max_tokens=parsed.max_tokens,
            stream=parsed.stream,
            headers=_scheduler_headers(request.headers),
            subset=subset,
            send_key=key,
        )

    def _schedule(
        self,
        prepared: Prepared,
        llm_request: LLMRequest,
        candidates: list[EndpointState],
        *,
        flow: str,
        now: float | None,
    ) -> RoutingDecision:
        request, parsed, pool_key = prepared.request, prepared.parsed, prepared.pool_key
        target, criticality = prepared.target, prepared.criticality
        if now is None:
            now = self._clock()
        result = self._scheduler.schedule(llm_request, candidates, now=now)
        endpoints = self._destinations(result, candidates)
        if not endpoints:
            learner = self._learner
            if learner is not None:  # PostCycle counted the send: no ticket will end it
                learner.request_ended(llm_request.key)
            raise NoReadyEndpoint(f"no endpoint of pool {pool_key} can take the request")

        server_names_model = _names_responses_itself(candidates, endpoints)
        passes_epp = (
            not self._responses_observed
            or server_names_model
            or model_renamed(target, parsed.model)
        )
        inject = should_inject_usage(
            parsed, enabled=self._config.inject_stream_usage and passes_epp
        )
        body = None
        if inject or target != parsed.model:
            body = rewrite_body(
                parsed.payload,
                model=target if target != parsed.model else None,
                include_usage=inject,
            )
        key = llm_request.key
        self._inflight.start(key, endpoints[0], parsed.prompt_tokens, now, target)
        return RoutingDecision(
            request_id=request.request_id,
            endpoints=endpoints,
            pool=pool_key,
            model_name=parsed.model,
            target_model=target,
            criticality=criticality,
            priority=prepared.priority,
            stream=parsed.stream,
            prompt_tokens=parsed.prompt_tokens,
            body=body,
            include_usage_injected=inject,
            server_names_model=server_names_model,
            ticket=Ticket(
                key, endpoints[0], parsed.prompt_tokens, now, flow, criticality, model=target
            ),
        )

    def _route_bodyless(self, request: IncomingRequest, snapshot: SnapshotView) -> RoutingDecision:
        pool_key = self._default_pool(snapshot)
        states = self._candidates(snapshot, pool_key, self._subset(request))
        count = min(len(states), 1 + self._config.fallback_endpoints)
        picked = self._rng.sample(range(len(states)), count)
        return RoutingDecision(
            request_id=request.request_id,
            endpoints=tuple(states[i].key for i in picked),
            pool=pool_key,
            # Keyed like any send: its end is told the learners, and a bare client id could
            # name another send's key.
            ticket=Ticket(self._send_key(request), "", 0, self._clock()),
        )

    def _destinations(
        self, result: SchedulingResult, candidates: Sequence[EndpointState]
    ) -> tuple[str, ...]:
        """The scheduler's targets as `ip:port`, best first, capped by `fallbackEndpoints`.

        Only candidates can be destinations: whatever a (buggy or custom) plugin returns, the
        gateway never sends a request to an address outside the pool (reliability F4).
        """
        allowed = {s.key for s in candidates}
        out: list[str] = []
        for target in result.targets:
            key = target.key
            if key not in allowed:
                log.error("scheduler returned %s, which is not a candidate; ignored", key)
            elif key not in out:
                out.append(key)
                if len(out) > self._config.fallback_endpoints:
                    break
        return tuple(out)

    def _default_pool(self, snapshot: SnapshotView) -> str:
        pool_keys = snapshot.pool_keys()
        wanted = self._config.default_pool
        if wanted is not None:
            if wanted not in pool_keys:
                raise NoReadyEndpoint(f"default pool {wanted} is not loaded")
            return wanted
        if not pool_keys:
            raise NoReadyEndpoint("no InferencePool is loaded")
        return pool_keys[0]

    def _subset(self, request: IncomingRequest) -> frozenset[str] | None:
        if request.subset_hint is None or not self._config.honor_subset_hint:
            return None
        return frozenset(request.subset_hint)

    def _candidates(
        self, snapshot: SnapshotView, pool_key: str, subset: frozenset[str] | None
    ) -> list[EndpointState]:
        states = list(snapshot.states(pool_key))
        if subset is not None:
            ips = {host_of(entry) for entry in subset}
            states = [s for s in states if s.endpoint.address in ips]
            if not states:
                raise NoReadyEndpoint(
                    f"no endpoint of pool {pool_key} is in the proxy's endpoint subset"
                )
        if not states:
            raise NoReadyEndpoint(f"pool {pool_key} has no ready endpoint")
        return states

    # --- response path --------------------------------------------------------------------

    def served(self, decision: RoutingDecision, endpoint: str) -> None:
        """The proxy reports the endpoint that actually serves (a fallback, after a retry):
        move the in-flight accounting there. Unknown endpoints (not in the decision) are ignored.
        """
        ticket = decision.ticket
        if not isinstance(ticket, Ticket) or ticket.done or not ticket.endpoint:
            return
        if endpoint == ticket.endpoint or endpoint not in decision.endpoints:
            return
        self._inflight.finish(ticket.key)
        self._inflight.start(ticket.key, endpoint, ticket.tokens, self._clock(), ticket.model)
        ticket.endpoint = endpoint

    def first_byte(self, decision: RoutingDecision, *, after_s: float | None = None) -> None:
        """The first response byte arrived: the observer's time to first token (sent -> now,
        on the decision's clock; or sent -> sent + `after_s` when the response observer
        reports it after the fact); for a stream, the in-flight tracker stops counting it as
        queued, and a scheduler that learns from first tokens gets one observation."""
        ticket = decision.ticket
        if not isinstance(ticket, Ticket) or ticket.done:
            return
        at = self._clock() if after_s is None else ticket.started_at + max(0.0, after_s)
        if self.observer is not None and decision.model_name:
            self.observer.first_token(decision, max(0.0, at - ticket.started_at))
        if not decision.stream:
            return
        if ticket.endpoint:
            self._inflight.first_token(ticket.key)
        learner = self._learner
        if learner is not None:
            learner.observe_first_token(ticket.key, ticket.endpoint, at)
        if self._wake is not None:
            self._wake()  # a prefill ended: requests `holdNewPrefixes` holds ask again

    def complete(
        self,
        decision: RoutingDecision,
        *,
        status: int | None,
        usage: Usage | None,
        served_endpoint: str | None = None,
    ) -> None:
        """The request ended (any outcome, including cancellation). Idempotent."""
        ticket = decision.ticket
        if not isinstance(ticket, Ticket) or ticket.done:
            return
        ticket.done = True
        if self._learner is not None:
            self._learner.request_ended(ticket.key)
        # In-flight accounting is keyed by the send key, so it ends wherever it sits (the primary,
        # or the fallback `served` moved it to); `served_endpoint` needs no further move here.
        if ticket.flow:
            output = usage.completion_tokens if usage is not None else 0
            self._gate.completed(decision.pool, ticket.flow, ticket.band, output)
        if ticket.endpoint:
            if status is not None and 200 <= status < 300 and usage is not None:
                # A success with usage is a speed observation: the tracker measures the time
                # since `start` (or since `served` moved it to a fallback) on the same clock.
                self._inflight.finish(
                    ticket.key, now=self._clock(), output_tokens=usage.completion_tokens
                )
            else:
                self._inflight.finish(ticket.key)

    # --- introspection --------------------------------------------------------------------

    def model_names(self) -> list[str]:
        """Every client-facing modelName, sorted (for GET /v1/models)."""
        return list(self._datastore.snapshot().model_names())

    def ready(self) -> bool:
        """Resources are loaded and the last scrape of at least one endpoint succeeded."""
        snapshot = self._datastore.snapshot()
        return any(
            state.metrics.reachable
            for pool_key in snapshot.pool_keys()
            for state in snapshot.states(pool_key)
        )


def _scheduler_headers(headers: Mapping[str, str]) -> Mapping[str, str]:
    """Request headers without the gateway's control headers (never trusted from clients)."""
    # One C-level search over the names joined, not a `startswith` per header on every
    # request; a name that only looks like one after a newline just takes the exact path.
    if _CONTROL_NAME_START not in "\n" + "\n".join(headers):
        return headers
    return {k: v for k, v in headers.items() if not k.startswith(_CONTROL_HEADER_PREFIX)}
