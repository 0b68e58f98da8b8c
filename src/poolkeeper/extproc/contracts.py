"""What the ext_proc front end needs from the rest of the gateway, and its settings.

The consumer owns these interfaces: the Director satisfies `RequestRouter`, the telemetry layer
`ExchangeObserver`; protocol tests use small fakes of either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm

from poolkeeper.errors import GatewayError
from poolkeeper.extproc.messages import MAX_BODY_CHUNK
from poolkeeper.requestcontrol.types import IncomingRequest, RoutingDecision, Usage

BodyMode = pm.ProcessingMode.BodySendMode
STREAMED = pm.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = pm.ProcessingMode.BUFFERED
CANCELLED_STATUS = 499  # nginx's "client closed request": the stream ended before the response


class RequestRouter(Protocol):
    """What the ext_proc front end needs from the Director (the consumer owns this interface)."""

    async def route(self, request: IncomingRequest) -> RoutingDecision: ...

    def complete(
        self,
        decision: RoutingDecision,
        *,
        status: int,
        usage: Usage | None,
        served_endpoint: str | None = None,
    ) -> object: ...

    def served(self, decision: RoutingDecision, endpoint: str) -> None: ...

    def first_byte(self, decision: RoutingDecision, *, after_s: float | None = None) -> None:
        """The first non-empty response body chunk of a successful response passed: now, or
        (from the response observer, told afterwards) `after_s` after the request was sent."""
        ...

    def model_names(self) -> list[str]: ...

    def ready(self) -> bool: ...


class ExchangeObserver(Protocol):
    """Metrics hooks; the telemetry layer implements them."""

    def routed(
        self, decision: RoutingDecision, request_bytes: int, route_seconds: float
    ) -> None: ...

    def rejected(self, model_name: str, error: GatewayError, request_bytes: int) -> None: ...

    def finished(
        self,
        decision: RoutingDecision,
        *,
        status: int,
        usage: Usage | None,
        seconds: float,
        response_bytes: int,
    ) -> None: ...


class NullObserver:
    def routed(self, decision: RoutingDecision, request_bytes: int, route_seconds: float) -> None:
        pass

    def rejected(self, model_name: str, error: GatewayError, request_bytes: int) -> None:
        pass

    def finished(
        self,
        decision: RoutingDecision,
        *,
        status: int,
        usage: Usage | None,
        seconds: float,
        response_bytes: int,
    ) -> None:
        pass


@dataclass(frozen=True, slots=True)
class ExtProcSettings:
    default_body_mode: int = STREAMED  # used when Envoy sends no protocol_config
    max_request_body_bytes: int = 16 << 20
    max_response_capture_bytes: int = 8 << 20  # JSON bodies kept for usage parsing
    models_path: str = "/v1/models"
    # GET models_path answered from router.model_names() (requestHandling.answerModelsList);
    # off, it is a body-less request like any other, routed to a model server (upstream).
    answer_models: bool = False
    body_chunk_bytes: int = MAX_BODY_CHUNK
    # Paths the EPP routes (None: any); others get 404 not_found. Envoy's listener enforces
    # the same allowlist first; this guards EPPs behind another proxy (`serve --no-envoy`).
    inference_paths: frozenset[str] | None = None
    # (headers, KiB) a client may send, counted as `messages.request_header_map` does; more
    # get 431 before routing (None: unchecked). `serve` sets Envoy's listener limits above
    # these (envoy/params.py HEADER_HEADROOM) so the EPP's own header mutation always fits.
    client_header_limits: tuple[int, int] | None = None
    # Conformance: answer every response with `x-conformance-test-served-endpoint` (upstream's
    # destination-endpoint-served-verifier); off unless configured.
    conformance_served_header: bool = False
    # ext_proc streams held at once (requestHandling.maxStreams); more get RESOURCE_EXHAUSTED.
    max_streams: int = 16_384


class BodyBudget:
    """Request-body bytes held by every exchange of one EPP together (reliability finding 3):
    hostile bodies are refused once the budget is spent instead of growing memory."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.peak = 0  # highest `used` since the owner last reset it (memory trimming)

    def take(self, n: int) -> bool:
        if self.used + n > self.limit:
            return False
        self.used += n
        self.peak = max(self.peak, self.used)
        return True

    def give(self, n: int) -> None:
        self.used = max(0, self.used - n)
