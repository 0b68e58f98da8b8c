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

The exchange is one class in three layers: `exchange_state.ExchangeState` (its state and its
end), `response_path.ResponsePath` (the response half) and `Exchange` here (dispatch and the
request half: headers, body, routing, refusals).
"""

from __future__ import annotations

import logging
import uuid

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from poolkeeper.errors import (
    GatewayError,
    PathNotFound,
    PayloadTooLarge,
    ServerBusy,
    UnsupportedEncoding,
)
from poolkeeper.extproc import messages as msg, request_fields, routing_replies, wire
from poolkeeper.extproc.contracts import BUFFERED
from poolkeeper.extproc.exchange_state import Phase, Replies
from poolkeeper.extproc.response_path import ResponsePath
from poolkeeper.requestcontrol.types import IncomingRequest, RoutingDecision

log = logging.getLogger("poolkeeper.extproc")


class Exchange(ResponsePath):
    """State of one ext_proc stream. Feed each ProcessingRequest to `handle`."""

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
                self.hint = request_fields.subset_hint(request)
            self.served = request_fields.served_endpoint(request) or self.served
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
        self.headers, count, size = request_fields.request_header_map(headers)
        if request_fields.may_name_gateway_headers(self.headers):
            self.spoofed = [
                h for h in self.headers if h.startswith(request_fields.ROUTING_HEADER_PREFIX)
            ]
            for name in self.spoofed:
                del self.headers[name]
            # Removed on the way upstream; routing headers are also hidden from the Director.
            self.stripped = self.spoofed + [
                h for h in self.headers if h in request_fields.CONTROL_HEADERS
            ]
        self.request_id = self.headers.get("x-request-id") or uuid.uuid4().hex
        too_large = request_fields.header_limit_error(
            count, size, self.settings.client_header_limits
        )
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
                routing_replies.routing_reply(
                    decision.endpoints, None, self.stripped, key, via_epp=via_epp
                )
            ]
        if self.request_mode == BUFFERED:
            self._release_body()
            return [
                routing_replies.buffered_routing_reply(
                    decision.endpoints, decision.body, self.stripped, key, via_epp=via_epp
                )
            ]
        replies = [
            routing_replies.routing_reply(
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
