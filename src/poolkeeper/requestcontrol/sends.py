"""The Director's bookkeeping of its sends, from the decision to the response's end: each
send's key and `Ticket`, the in-flight accounting moved to the endpoint that serves, the first
byte (time to first token, the learners, `holdNewPrefixes`' wake-up) and the end (the gate's
charge, the tracker's speed observation, a successful end's usage to the learners that count
steps by it). `Sends` is `director.Director`'s base.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from poolkeeper.api.criticality import Criticality
from poolkeeper.requestcontrol.ports import (
    Gate,
    InflightLike,
    LearningSchedulerLike,
    UsageLearnerLike,
)
from poolkeeper.requestcontrol.types import IncomingRequest, RoutingDecision, Usage


def ok(status: int) -> bool:
    return 200 <= status < 300


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


class Sends:
    """What the Director keeps of each send until its end (its response-path half)."""

    def __init__(
        self,
        *,
        inflight: InflightLike,
        gate: Gate,
        learner: LearningSchedulerLike | None,
        wake: Callable[[], None] | None,
        clock: Callable[[], float],
    ) -> None:
        self._inflight = inflight
        self._gate = gate
        self._learner = learner  # the scheduler, when a plugin learns from first tokens
        # and, where it counts steps by the usage (the step-phase scorer), its end with it
        self._done: Callable[[str, float, int], None] | None = (
            learner.request_done if isinstance(learner, UsageLearnerLike) else None
        )
        self._wake = wake  # flow control's `holdNewPrefixes` asks again on a first byte
        self._clock = clock
        self._sequence = itertools.count()
        self.observer: DirectorObserver | None = None  # set by the runtime (metrics)

    @property
    def inflight(self) -> InflightLike:
        return self._inflight

    @property
    def wants_first_tokens_at_once(self) -> bool:
        """Whether first tokens should be reported as they happen (`server/envoy_bootstrap.py`'s
        bootstrap): the scheduler learns from them, or flow control's `holdNewPrefixes`
        asks its held requests again on each (a prefill ended). Reported only at the
        request's end, a held request would wait for completions instead."""
        return self._learner is not None or self._wake is not None

    def _send_key(self, request: IncomingRequest) -> str:
        """This send's identity: the client's id (clients choose it, so two live sends may
        carry one) and the Director's sequence. The in-flight tracker, the learners (the
        backlog, its cross-replica sync) and the ticket all key by it, end to end."""
        return f"{request.request_id}#{next(self._sequence)}"

    def _abandon(self, decision: RoutingDecision) -> None:
        self.complete(decision, status=None, usage=None)

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
        learner = self._learner
        if learner is not None:
            done = self._done
            if done is not None and usage is not None and status is not None and ok(status):
                done(ticket.key, self._clock(), usage.completion_tokens)  # the usage, live
            learner.request_ended(ticket.key)
        # In-flight accounting is keyed by the send key, so it ends wherever it sits (the primary,
        # or the fallback `served` moved it to); `served_endpoint` needs no further move here.
        if ticket.flow:
            output = usage.completion_tokens if usage is not None else 0
            self._gate.completed(decision.pool, ticket.flow, ticket.band, output)
        if ticket.endpoint:
            if status is not None and ok(status) and usage is not None:
                # A success with usage is a speed observation: the tracker measures the time
                # since `start` (or since `served` moved it to a fallback) on the same clock.
                self._inflight.finish(
                    ticket.key, now=self._clock(), output_tokens=usage.completion_tokens
                )
            else:
                self._inflight.finish(ticket.key)
