"""What the Director needs from its collaborators: the ports it is written against.

The datastore snapshot, the scheduler (and, when a plugin learns from first tokens, its
learning side; with `holdNewPrefixes`, the two prefill facts flow control asks of it), the
in-flight tracker and the gate. The Director depends on these protocols
only; `server/wiring.py` plugs the real objects in, tests plug fakes.

The gate answers "may this request go now?" for every request that has a body, with or without
flow control: the Director hands it a `Job` and gets a RoutingDecision (it went), a queued
item to `wait` on, or a GatewayError (429 shed or queue full, 503). Its implementations are
`requestcontrol/flowgate.py`'s `FlowGate` (queue, `flowControl.enabled`) and
`requestcontrol/shedgate.py`'s `ShedGate` (admit or shed at once); the decisions themselves
are `flowcontrol/`'s.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from poolkeeper.api.criticality import Criticality
from poolkeeper.api.objective import InferenceObjective
from poolkeeper.api.pool import AnyInferencePool
from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.datastore.models import ModelRoute, RewriteRule
from poolkeeper.flowcontrol.flowitem import FlowItem
from poolkeeper.requestcontrol.types import RoutingDecision
from poolkeeper.scheduling.types import LLMRequest, SchedulingResult


class SnapshotView(Protocol):
    """The part of a datastore snapshot the Director reads."""

    def pool_keys(self) -> Sequence[str]: ...

    def resolve(self, model_name: str) -> ModelRoute | None: ...

    def model_names(self) -> Sequence[str]: ...

    def rewrite_rule(self, pool_key: str, model_name: str) -> RewriteRule | None: ...

    def objective(self, pool_key: str, name: str) -> InferenceObjective | None: ...

    def states(self, pool_key: str) -> Sequence[EndpointState]: ...

    def pool(self, pool_key: str) -> AnyInferencePool | None: ...


class SnapshotSource(Protocol):
    def snapshot(self) -> SnapshotView: ...


class SchedulerLike(Protocol):
    def schedule(
        self, request: LLMRequest, candidates: Sequence[EndpointState], *, now: float
    ) -> SchedulingResult: ...


@runtime_checkable
class LearningSchedulerLike(SchedulerLike, Protocol):
    """A scheduler with a plugin that learns from first tokens (the predicted-TTFT scorer)."""

    @property
    def observes_first_tokens(self) -> bool: ...

    # `request_id` in both: the decided `LLMRequest.key` (the send key), not the client's id.
    def observe_first_token(self, request_id: str, endpoint: str | None, now: float) -> None: ...

    def request_ended(self, request_id: str) -> None: ...


@runtime_checkable
class UsageLearnerLike(Protocol):
    """A scheduler told a successful end's time and usage (the step-phase scorer counts a
    request's steps by its output tokens)."""

    def request_done(self, request_id: str, now: float, output_tokens: int) -> None: ...


class PrefillFactsLike(Protocol):
    """What `holdNewPrefixes` asks the scheduler before dispatch (`scheduling/prefillfacts.py`
    answers from its plugins): a request's prompt tokens no endpoint caches, and each
    candidate's prefill backlog (prompt tokens sent there without a first byte back); and
    what a band's `avoidPrefillUnlessCached` asks: the request's prefix match per endpoint."""

    def uncached_tokens(self, request: LLMRequest, now: float) -> int: ...

    def backlogs(
        self, endpoints: Sequence[EndpointState], now: float | None = None
    ) -> list[int]: ...

    def cached_tokens(self, request: LLMRequest, now: float) -> dict[str, int]: ...


class InflightLike(Protocol):
    def start(
        self,
        request_id: str,
        endpoint_key: str,
        tokens: int,
        now: float,
        model: str | None = None,
    ) -> object: ...

    def finish(
        self, request_id: str, *, now: float | None = None, output_tokens: int | None = None
    ) -> object: ...

    def apply(self, states: Sequence[EndpointState]) -> list[EndpointState]: ...

    def first_token(self, request_id: str) -> object: ...


class PeerLoadLike(Protocol):
    """Other replicas' load the states lack (`replicasync.peerunseen.PeerUnseen`)."""

    def apply(self, states: Sequence[EndpointState]) -> list[EndpointState]: ...


@dataclass(eq=False, slots=True)
class Job:
    """One request, as the Director hands it to the gate: what it is, and how to read its
    candidates and to schedule it (the Director's, called by the gate)."""

    request_id: str
    pool: str
    model: str  # client-facing model name (metrics, error labels)
    target: str  # target model after the split (error labels; a LoRA adapter's headroom)
    criticality: Criticality
    flow: str  # the fairness key: the modelName, or the trusted fairness-id header
    tokens: int  # prompt tokens
    size: int  # request bytes
    # The candidate endpoints now, with this router's in-flight counts; raises NoReadyEndpoint.
    states: Callable[[], list[EndpointState]]
    # Schedule it on these candidates (None: read them now) at `now` (None: the clock's now);
    # accounts for the request before it returns (late binding). Raises GatewayError.
    run: Callable[[list[EndpointState] | None, float | None], RoutingDecision]
    # Hand back a decision nobody waits for any more (ends its accounting).
    abandon: Callable[[RoutingDecision], None]
    # FlowGate's: the endpoints with room its last headroom check found, and the waiter.
    ready: list[EndpointState] | None = None
    future: asyncio.Future[RoutingDecision] | None = None
    # The InferenceObjective priority (0 when none applies): the flow-control metrics' label.
    priority: int = 0
    # The request's bound on its answer (max_tokens; None: unbounded): fair sharing charges
    # it ahead while the flow has no answers yet (flowcontrol/answers.py).
    max_tokens: int | None = None
    # `holdNewPrefixes`' question on these candidates: (the prompt tokens no endpoint caches,
    # asked only if needed, each candidate's prefill backlog), the scheduler's facts
    # (`PrefillFactsLike`). None: the Director has no facts (the hold is off), and the gate
    # never holds the request.
    prefill: Callable[[list[EndpointState]], tuple[Callable[[], int] | int, list[int]]] | None = (
        None
    )
    # A band's `avoidPrefillUnlessCached`: the request's prompt tokens each endpoint (ip:port)
    # probably caches, asked only when needed (`flowcontrol/avoidance.py`). None: no facts.
    cached: Callable[[], Mapping[str, int]] | None = None
    # FlowGate's: seconds the request was held in front of the queue (counted as queue time).
    held_s: float = 0.0
    released: bool = False  # released from a `holdNewPrefixes` hold (`placeUnderBacklog`)


class Gate(Protocol):
    """Whether and when a request goes (see the module docstring)."""

    def submit(self, job: Job) -> RoutingDecision | FlowItem[Job]:
        """Dispatch now (`job.run`), or queue (the item to `wait` on); raises GatewayError."""
        ...

    async def wait(self, item: FlowItem[Job]) -> RoutingDecision:
        """The decision for a queued item; cancelling the call takes it out of the queue."""
        ...

    def withdraw(self, item: FlowItem[Job]) -> None:
        """Take a queued item back (its caller cannot wait)."""
        ...

    def completed(self, pool: str, flow: str, band: Criticality, output_tokens: int) -> None:
        """A dispatched request of `flow` ended with `output_tokens` (fairness, wake-ups)."""
        ...
