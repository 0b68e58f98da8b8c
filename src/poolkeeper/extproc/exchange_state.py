"""One exchange's state (`ExchangeState`, the base of `state.Exchange`) and how it ends.

The state: phase, body modes, the request's headers and body (its bytes taken from the shared
budget), the routing decision, the response's status, filters and counts. The end, exactly
once whichever comes first: the response's end on this stream (`_finish`), Envoy's access-log
entry for a detached request (`observed`), or the stream's end (`close`: cancelled); each
tells the router (`complete`) and the observer (`finished`), and logs the request's line.
The first response byte is told to the router once (`_first_byte`).
"""

from __future__ import annotations

import enum
import inspect
import logging
import time
from collections.abc import Callable

from poolkeeper.extproc import wire
from poolkeeper.extproc.accesslog import DetachedExchanges
from poolkeeper.extproc.contracts import (
    CANCELLED_STATUS,
    BodyBudget,
    ExchangeObserver,
    ExtProcSettings,
    NullObserver,
    RequestRouter,
)
from poolkeeper.extproc.model_name import ModelNameRewriter
from poolkeeper.extproc.outcome import Outcome
from poolkeeper.extproc.usage import SseUsageFilter, usage_from_json
from poolkeeper.requestcontrol.types import RoutingDecision, Usage

log = logging.getLogger("poolkeeper.extproc")


class Phase(enum.Enum):
    REQUEST_HEADERS = "request_headers"
    REQUEST_BODY = "request_body"
    ROUTED = "routed"  # request side answered, waiting for the response
    RESPONSE = "response"
    DONE = "done"  # finished or answered with an ImmediateResponse


Replies = list[wire.Reply]  # body mutations in wire form (wire.WireReply), the rest protobuf


class ExchangeState:
    """One ext_proc stream's state and its end (`state.Exchange` handles its messages)."""

    def __init__(
        self,
        router: RequestRouter,
        *,
        settings: ExtProcSettings | None = None,
        observer: ExchangeObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
        budget: BodyBudget | None = None,
        detached: DetachedExchanges | None = None,
    ) -> None:
        self.router = router
        # With the response observer (extproc/accesslog.py): a routed request leaves this
        # stream; Envoy's access log reports how it ended, or, for a response the EPP
        # rewrites, the response processor's stream resumes it (`resumed`).
        self.detached = detached
        self.detach_key: str | None = None
        self.generation = 0  # which gRPC stream has it: 1 once the response processor's does
        self.budget = budget
        self.budgeted = 0  # bytes of `body` taken from the shared budget
        self.settings = settings or ExtProcSettings()
        self.observer: ExchangeObserver = observer or NullObserver()
        self.clock = clock
        self.phase = Phase.REQUEST_HEADERS
        self.started = clock()
        self.request_mode = self.settings.default_body_mode
        self.response_mode = self.settings.default_body_mode
        self.headers: dict[str, str] = {}
        self.spoofed: list[str] = []
        self.stripped: list[str] = []
        self.hint: tuple[str, ...] | None = None
        self.request_id = ""
        # The request body's chunks, joined once when routing: appending each to one
        # bytearray copied it again whenever it grew (1 MiB in 64 KiB chunks: ~1 ms).
        self.body: list[bytes | memoryview] = []
        self.body_bytes = 0
        self.decision: RoutingDecision | None = None
        self.status = 0
        self.served: str | None = None
        self.sse: SseUsageFilter | None = None
        # JSON responses whose model name goes back to the client's: held to the end.
        self.json_rewrite: ModelNameRewriter | None = None
        self.held = bytearray()
        self.captured = bytearray()
        self.response_bytes = 0
        self.first_byte_seen = False  # told to the router (once per request)
        self.completed = False
        self.header_only = False  # the request headers carried end_of_stream

    def _release_body(self) -> None:
        """The body is no longer needed (routed, refused, or the stream ended)."""
        self.body = []
        self.body_bytes = 0
        if self.budget is not None and self.budgeted:
            self.budget.give(self.budgeted)
        self.budgeted = 0

    def first_byte_passed(self) -> None:
        """A detached request's first response byte passed Envoy now (its Lua filter's
        report): told to the router at once, not only with the access-log entry."""
        if not self.completed:
            self._first_byte()

    def _first_byte(self) -> None:
        if self.decision is None or self.first_byte_seen:
            return
        self.first_byte_seen = True
        try:
            self.router.first_byte(self.decision)
        except Exception:
            log.exception("first-byte bookkeeping failed request_id=%s", self.request_id)

    # -- completion -------------------------------------------------------------------------
    def _finish(self) -> None:
        self.phase = Phase.DONE
        usage: Usage | None
        if self.sse is not None:
            usage = self.sse.usage
        else:
            usage = usage_from_json(bytes(self.captured)) if self.captured else None
        self._complete(self.status, usage)

    def resumed(self) -> None:
        """The response processor's stream takes this request over (its response needs the
        EPP): from here on it ends like any other, with that stream."""
        self.detach_key = None
        self.generation += 1
        self.phase = Phase.ROUTED

    def observed(self, outcome: Outcome) -> None:
        """A detached request ended (its access-log entry, or given up on as unknown)."""
        decision = self.decision
        if decision is None or self.completed:
            return
        self.served = outcome.served or self.served
        self.status = outcome.status
        self.response_bytes = outcome.response_bytes
        if (
            not self.first_byte_seen
            and outcome.first_byte_after_s is not None
            and 200 <= outcome.status < 300
        ):
            try:
                self.router.first_byte(decision, after_s=outcome.first_byte_after_s)
            except Exception:
                log.exception("first-byte bookkeeping failed request_id=%s", self.request_id)
        # Envoy's own duration: the entry itself arrives up to a flush interval later.
        self._complete(outcome.status, _usage_of(outcome, decision), seconds=outcome.duration_s)

    def close(self, generation: int = 0) -> None:
        """End of the gRPC stream for any reason (before any hand-off): release whatever is
        still held. `generation`: the stream's; an earlier stream than the one that has the
        request now changes nothing."""
        if generation != self.generation:
            return
        if self.detach_key is not None and self.detached is not None:
            self.detached.discard(self.detach_key)  # Envoy may never have had the replies
            self.detach_key = None
        if not self.completed and self.decision is not None:
            usage = self.sse.usage if self.sse is not None else None
            self._complete(CANCELLED_STATUS, usage)
        self._release_body()
        self.phase = Phase.DONE

    def _complete(self, status: int, usage: Usage | None, *, seconds: float | None = None) -> None:
        if self.completed or self.decision is None:
            return
        self.completed = True
        decision = self.decision
        if seconds is None:
            seconds = self.clock() - self.started
        try:
            result = self.router.complete(
                decision, status=status, usage=usage, served_endpoint=self.served
            )
            if inspect.iscoroutine(result):
                result.close()  # the contract is synchronous; never leave a coroutine pending
                log.error("router.complete returned a coroutine; it must be synchronous")
        except Exception:
            log.exception("completion bookkeeping failed request_id=%s", self.request_id)
        self.observer.finished(
            decision,
            status=status,
            usage=usage,
            seconds=seconds,
            response_bytes=self.response_bytes,
        )
        # One line per request (the EPP's access log); never the body.
        log.info(
            "completed request_id=%s model=%s target=%s criticality=%s status=%d endpoint=%s "
            "seconds=%.3f",
            self.request_id,
            decision.model_name,
            decision.target_model,
            decision.criticality,
            status,
            self.served or decision.endpoints[0],
            seconds,
        )


def _usage_of(outcome: Outcome, decision: RoutingDecision) -> Usage | None:
    """The response's own usage; else, for a stream, an estimate (one token per SSE event that
    is not `[DONE]`, the prompt as the EPP counted it), marked as such."""
    if outcome.prompt_tokens is not None or outcome.completion_tokens is not None:
        return Usage(
            prompt_tokens=outcome.prompt_tokens or 0,
            completion_tokens=outcome.completion_tokens or 0,
            cached_tokens=outcome.cached_tokens,
        )
    generated = outcome.events - outcome.done_events
    if decision.stream and generated > 0:
        return Usage(
            prompt_tokens=decision.prompt_tokens,
            completion_tokens=generated,
            estimated=True,
        )
    return None
