"""One ext_proc stream (one HTTP request) as a state machine: phases, replies, bookkeeping.

Envoy sends request headers, body chunks, trailers, then response headers, body chunks,
trailers. In FULL_DUPLEX_STREAMED mode the EPP holds its request-headers reply until the whole
body has arrived and been routed, then answers headers → body (≤ 62,000-byte chunks) in that
order; in BUFFERED mode every message is answered as it comes and the decision rides on the
body reply. Response messages are answered one for one. After an ImmediateResponse nothing more
is sent. `close()` runs when a stream ends before any hand-off (normal end, error or
cancellation) and releases the request's in-flight accounting exactly once.

With the response observer (`extproc/accesslog.py`) a request lives on two or three streams'
worth of time: its own stream ends once routed (the hand-off); then either `observed()` (Envoy's
access log) or, for a response the EPP rewrites, `resumed()` by the response processor's stream
ends it, exactly once either way.
"""

from __future__ import annotations

import enum
import inspect
import logging
import time
import uuid
from collections.abc import Callable

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from poolkeeper.errors import (
    GatewayError,
    PathNotFound,
    PayloadTooLarge,
    ServerBusy,
    UnsupportedEncoding,
)
from poolkeeper.extproc import messages as msg, wire
from poolkeeper.extproc.accesslog import DetachedExchanges, Outcome
from poolkeeper.extproc.contracts import (
    BUFFERED,
    CANCELLED_STATUS,
    BodyBudget,
    ExchangeObserver,
    ExtProcSettings,
    NullObserver,
    RequestRouter,
)
from poolkeeper.extproc.model_name import ModelNameRewriter, rewriter_for
from poolkeeper.extproc.usage import SseUsageFilter, usage_from_json
from poolkeeper.requestcontrol.types import IncomingRequest, RoutingDecision, Usage

log = logging.getLogger("poolkeeper.extproc")


class Phase(enum.Enum):
    REQUEST_HEADERS = "request_headers"
    REQUEST_BODY = "request_body"
    ROUTED = "routed"  # request side answered, waiting for the response
    RESPONSE = "response"
    DONE = "done"  # finished or answered with an ImmediateResponse


Replies = list[wire.Reply]  # body mutations in wire form (wire.WireReply), the rest protobuf


class Exchange:
    """State of one ext_proc stream. Feed each ProcessingRequest to `handle`."""

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

    # -- dispatch ---------------------------------------------------------------------------
    async def handle(self, request: wire.Request) -> Replies:
        if isinstance(request, wire.BodyChunk):  # a body chunk alone (the lean transport's)
            if self.phase is Phase.DONE:
                return []
            return await self._request_body(request.body, end_of_stream=request.end_of_stream)
        if request.HasField("protocol_config"):
            self.request_mode = request.protocol_config.request_body_mode
            self.response_mode = request.protocol_config.response_body_mode
        if request.HasField("metadata_context"):  # both read nothing else (most messages)
            if self.hint is None:
                self.hint = msg.subset_hint(request)
            self.served = msg.served_endpoint(request) or self.served
        if self.phase is Phase.DONE:
            return []  # after an ImmediateResponse Envoy is closing; nothing more to say
        kind = request.WhichOneof("request")
        if kind == "request_headers":
            return await self._request_headers(request.request_headers)
        if kind == "request_body":
            body = request.request_body
            # Read once: each read of a protobuf bytes field is a fresh copy.
            return await self._request_body(body.body, end_of_stream=body.end_of_stream)
        if kind == "request_trailers":
            return await self._request_trailers()
        if kind == "response_headers":
            return self._response_headers(request.response_headers)
        if kind == "response_body":
            return self._response_body(request.response_body)
        if kind == "response_trailers":
            replies = self._flush_held()
            self._finish()
            return [*replies, msg.trailers_reply(response=True)]
        return []

    # -- request path -----------------------------------------------------------------------
    async def _request_headers(self, headers: pb.HttpHeaders) -> Replies:
        self.headers, count, size = msg.request_header_map(headers)
        if msg.may_name_gateway_headers(self.headers):
            self.spoofed = [h for h in self.headers if h.startswith(msg.ROUTING_HEADER_PREFIX)]
            for name in self.spoofed:
                del self.headers[name]
            # Removed on the way upstream; routing headers are also hidden from the Director.
            self.stripped = self.spoofed + [h for h in self.headers if h in msg.CONTROL_HEADERS]
        self.request_id = self.headers.get("x-request-id") or uuid.uuid4().hex
        too_large = msg.header_limit_error(count, size, self.settings.client_header_limits)
        if too_large is not None:
            return self._reject(too_large)
        method = self.headers.get(":method", "")
        path = self.headers.get(":path", "").split("?", 1)[0].rstrip("/")
        allowed = self.settings.inference_paths
        if allowed is not None and path not in allowed and path + "/" not in allowed:
            return self._reject(PathNotFound("no such inference API path on this gateway"))
        encoding = self.headers.get("content-encoding", "").strip().lower()
        if encoding and encoding != "identity":  # our Envoy refuses these first (routes.py)
            return self._reject(
                UnsupportedEncoding(
                    "Content-Encoding is not supported: send the body uncompressed (identity)"
                )
            )
        if self.settings.answer_models and method == "GET" and path == self.settings.models_path:
            self.phase = Phase.DONE
            return [msg.models_reply(self.router.model_names())]
        if headers.end_of_stream:  # header-only request: route now, body-less
            self.header_only = True
            return await self._route(trailers=False)
        self.phase = Phase.REQUEST_BODY
        if self.request_mode == BUFFERED:
            return [msg.request_headers_reply(msg.header_mutation(remove=self.stripped))]
        return []  # FULL_DUPLEX: the headers reply waits for the routing decision

    async def _request_body(self, data: bytes | memoryview, *, end_of_stream: bool) -> Replies:
        if self.phase is not Phase.REQUEST_BODY:
            return []
        if self.body_bytes + len(data) > self.settings.max_request_body_bytes:
            limit = self.settings.max_request_body_bytes
            return self._reject(PayloadTooLarge(f"request body exceeds {limit} bytes"))
        if self.budget is not None:
            if not self.budget.take(len(data)):
                return self._reject(
                    ServerBusy("too many request bytes in flight at the gateway; retry later")
                )
            self.budgeted += len(data)
        if data:
            self.body.append(data)
            self.body_bytes += len(data)
        if end_of_stream:
            return await self._route(trailers=False)
        if self.request_mode == BUFFERED:  # BUFFERED_PARTIAL-like pieces: let them continue
            return [msg.buffered_body_reply()]
        return []

    async def _request_trailers(self) -> Replies:
        if self.phase is Phase.REQUEST_BODY:  # body ended by trailers rather than end_of_stream
            return await self._route(trailers=True)
        return [msg.trailers_reply(response=False)]

    async def _route(self, *, trailers: bool) -> Replies:
        body = _joined(self.body)
        incoming = IncomingRequest(
            request_id=self.request_id,
            method=self.headers.get(":method", ""),
            path=self.headers.get(":path", ""),
            headers=self.headers,
            body=body,
            subset_hint=self.hint,
        )
        began = self.clock()
        try:
            decision = await self.router.route(incoming)
        except GatewayError as exc:
            return self._reject(exc)
        except Exception:
            log.exception("routing failed request_id=%s", self.request_id)
            return self._reject(GatewayError("internal error while routing the request"))
        if not decision.endpoints:
            return self._reject(GatewayError("the router returned no endpoint"))
        self.decision = decision
        self.phase = Phase.ROUTED
        self.observer.routed(decision, self.body_bytes, self.clock() - began)
        log.debug(
            "routed request_id=%s model=%s target=%s endpoint=%s",
            self.request_id,
            decision.model_name,
            decision.target_model,
            decision.endpoints[0],
        )
        return self._routing_replies(decision, body, trailers=trailers)

    def _routing_replies(
        self, decision: RoutingDecision, body: bytes, *, trailers: bool
    ) -> Replies:
        key: str | None = None
        via_epp = False
        if self.detached is not None:
            self.detach_key = key = self.detached.hold(self)
            via_epp = _rewrites_response(decision)
        out_body = body if decision.body is None else decision.body
        if self.header_only:  # nothing but the headers message to answer
            return [
                msg.routing_reply(decision.endpoints, None, self.stripped, key, via_epp=via_epp)
            ]
        if self.request_mode == BUFFERED:
            self._release_body()
            return [
                msg.buffered_routing_reply(
                    decision.endpoints, decision.body, self.stripped, key, via_epp=via_epp
                )
            ]
        replies = [
            msg.routing_reply(
                decision.endpoints, len(out_body), self.stripped, key, via_epp=via_epp
            )
        ]
        replies += wire.streamed_body_wire(
            out_body, end_of_stream=not trailers, size=self.settings.body_chunk_bytes
        )
        if trailers:
            replies.append(msg.trailers_reply(response=False))
        self._release_body()
        return replies

    def _release_body(self) -> None:
        """The body is no longer needed (routed, refused, or the stream ended)."""
        self.body = []
        self.body_bytes = 0
        if self.budget is not None and self.budgeted:
            self.budget.give(self.budgeted)
        self.budgeted = 0

    def _reject(self, error: GatewayError) -> Replies:
        size = self.body_bytes
        self._release_body()
        self.phase = Phase.DONE
        self.observer.rejected(error.model, error, size)
        log.info(
            "rejected request_id=%s status=%d code=%s",
            self.request_id,
            error.http_status,
            error.code,
        )
        return [msg.error_reply(error)]

    # -- response path ----------------------------------------------------------------------
    def _response_headers(self, headers: pb.HttpHeaders) -> Replies:
        self.phase = Phase.RESPONSE
        values = msg.header_map(headers)
        try:
            self.status = int(values.get(":status", "0"))
        except ValueError:
            self.status = 0
        self.served = values.get(msg.SERVED_KEY) or self.served
        if self.served and self.decision is not None and self.served != self.decision.endpoints[0]:
            # The proxy used a fallback: move the in-flight accounting to where it really is.
            try:
                self.router.served(self.decision, self.served)
            except Exception:
                log.exception("served-endpoint bookkeeping failed request_id=%s", self.request_id)
        mutation = None
        content_type = values.get("content-type", "")
        decision = self.decision
        rename = (
            rewriter_for(
                decision.target_model, decision.model_name, any_name=decision.server_names_model
            )
            if decision is not None
            else None
        )
        if "text/event-stream" in content_type:
            strip = decision is not None and decision.include_usage_injected
            self.sse = SseUsageFilter(strip_injected_usage=strip, rewrite=rename)
            if (strip or rename is not None) and "content-length" in values:
                mutation = msg.header_mutation(remove=["content-length"])
        elif rename is not None and "json" in content_type:
            self.json_rewrite = rename
            if "content-length" in values:
                mutation = msg.header_mutation(remove=["content-length"])
        if self.settings.conformance_served_header:
            mutation = self._with_served_header(mutation)
        if headers.end_of_stream:
            self._finish()
        return [msg.response_headers_reply(mutation)]

    def _with_served_header(self, mutation: pb.HeaderMutation | None) -> pb.HeaderMutation:
        """Upstream's destination-endpoint-served-verifier: the served endpoint from the
        proxy's `envoy.lb` metadata, or why it is missing, in a response header."""
        value = self.served or "fail: missing destination endpoint served metadata"
        out = mutation if mutation is not None else msg.header_mutation()
        served = msg.header_mutation({msg.CONFORMANCE_SERVED_HEADER: value})
        out.set_headers.extend(served.set_headers)
        return out

    def _response_body(self, body: pb.HttpBody) -> Replies:
        if self.phase is not Phase.RESPONSE:
            return []
        data = body.body
        if data and not self.response_bytes and 200 <= self.status < 300:
            self._first_byte()
        self.response_bytes += len(data)
        if self.sse is not None:
            out = self.sse.feed(data)
            if body.end_of_stream:
                out += self.sse.finish()
        else:
            out = data
            room = self.settings.max_response_capture_bytes - len(self.captured)
            if room > 0:
                self.captured += data[:room]
            if self.json_rewrite is not None:
                out = self._rewrite_json(data, end_of_stream=body.end_of_stream)
        if body.end_of_stream:
            self._finish()
        if self.response_mode == BUFFERED:
            changed = out != data
            return [msg.buffered_body_reply(body=out if changed else None, response=True)]
        return wire.streamed_body_wire(
            out,
            end_of_stream=body.end_of_stream,
            response=True,
            size=self.settings.body_chunk_bytes,
        )

    def _rewrite_json(self, data: bytes, *, end_of_stream: bool) -> bytes:
        """Hold a JSON body to its end, then give it the client's model name. A body larger
        than the capture limit is passed on unchanged (from then on, as it comes)."""
        rewrite = self.json_rewrite
        assert rewrite is not None
        self.held += data
        if end_of_stream:
            out = rewrite(bytes(self.held))
        elif len(self.held) > self.settings.max_response_capture_bytes:
            out = bytes(self.held)
            self.json_rewrite = None
        else:
            return b""
        self.held.clear()
        return out

    def _flush_held(self) -> Replies:
        """What is still held back when the response ends with trailers."""
        out = b""
        if self.sse is not None:
            out = self.sse.finish()
        elif self.json_rewrite is not None and self.held:
            out = self.json_rewrite(bytes(self.held))
            self.held.clear()
        if not out or self.phase is not Phase.RESPONSE or self.response_mode == BUFFERED:
            return []
        return wire.streamed_body_wire(
            out, end_of_stream=False, response=True, size=self.settings.body_chunk_bytes
        )

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


def _joined(chunks: list[bytes | memoryview]) -> bytes:
    """A request body's chunks as one `bytes`: joined once (the only copy of a body that came
    as views of its messages), a lone `bytes` chunk as it is."""
    if len(chunks) == 1:
        only = chunks[0]
        if isinstance(only, bytes):
            return only
    return b"".join(chunks)


def _rewrites_response(decision: RoutingDecision) -> bool:
    """Whether the EPP must see the response: to drop the usage chunk it asked for on the
    client's behalf, or to give the client's model name back."""
    return decision.include_usage_injected or decision.renames_response_model


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
