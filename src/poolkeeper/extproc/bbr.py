"""Body-based routing (BBR): the small ext_proc service that copies a request body's `model`
into the `x-gateway-model-name` header, so that routes can send different models to different
InferencePools (upstream `pkg/bbr`, `cmd/bbr`; HTTPRoutes match `X-Gateway-Model-Name`).

It runs in front of the Endpoint Picker: Envoy's filter chain is BBR, then the EPP of the pool the
route picked (`poolkeeper.envoy.bbr` builds that bootstrap; `poolkeeper bbr` runs this server).

Per stream (`BbrExchange`, pure and synchronous; `BbrServicer` is the async edge):
- request headers: over the client's header limits (`client_header_limits`), 431 at once (the
  BBR bootstrap's codec leaves room above them for the routing headers BBR and the EPP add, as
  serve's does for its EPP, which holds clients to them there); a header-only request is
  answered at once; otherwise, in FULL_DUPLEX_STREAMED mode, the headers reply waits for the
  body (as upstream's streaming server does);
- body: buffered to its end (at most `max_body_bytes`; more is 413), the model read with the
  EPP's own body rules (`requestcontrol.body.parse_model`), then the headers reply sets the header
  and `clear_route_cache` so Envoy picks the route again, and the body goes back unchanged;
- BUFFERED mode: the same mutation on the body reply.

A client's own `x-gateway-model-name` never survives: it is overwritten by the body's model, or
removed when the body names none (invalid JSON, no `model`, a value that is not a valid header
value). Upstream ends the stream on invalid JSON; poolkeeper forwards such a request without the
header so that the EPP or the model server answers it with a precise 400.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Final

import grpc
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import (
    external_processor_pb2 as pb,
    external_processor_pb2_grpc as pb_grpc,
)

from poolkeeper.errors import BadRequest, PayloadTooLarge
from poolkeeper.extproc import messages as msg, request_fields
from poolkeeper.requestcontrol.body import parse_model

log = logging.getLogger("poolkeeper.bbr")

MODEL_HEADER: Final = "x-gateway-model-name"  # upstream writes `X-Gateway-Model-Name`
MAX_HEADER_VALUE: Final = 1024
STREAMED: Final = pm.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED: Final = pm.ProcessingMode.BUFFERED
Replies = list[pb.ProcessingResponse]


def header_value(model: str) -> str | None:
    """`model` if it can travel as an HTTP header value (printable, no CR/LF, bounded)."""
    if len(model) > MAX_HEADER_VALUE or not model.isprintable() or model != model.strip():
        return None
    return model


def model_of(body: bytes) -> str | None:
    """The model a body names, as a header value; None when it names none usable."""
    try:
        return header_value(parse_model(body))
    except BadRequest:
        return None


class BbrExchange:
    """One ext_proc stream of the BBR service (see the module docstring)."""

    def __init__(
        self,
        *,
        max_body_bytes: int = 16 << 20,
        chunk_bytes: int = msg.MAX_BODY_CHUNK,
        client_header_limits: tuple[int, int] | None = None,  # (headers, KiB); None: unchecked
    ):
        self.max_body_bytes = max_body_bytes
        self.chunk_bytes = chunk_bytes
        self.client_header_limits = client_header_limits
        self.mode = STREAMED
        self.body = bytearray()
        self.model: str | None = None
        self.answered = False  # the request headers/body have been answered
        self.done = False

    def handle(self, request: pb.ProcessingRequest) -> Replies:
        if request.HasField("protocol_config"):
            self.mode = request.protocol_config.request_body_mode
        if self.done:
            return []
        kind = request.WhichOneof("request")
        if kind == "request_headers":
            if self.client_header_limits is not None:
                _, count, size = request_fields.request_header_map(request.request_headers)
                too_large = request_fields.header_limit_error(
                    count, size, self.client_header_limits
                )
                if too_large is not None:
                    self.done = True
                    return [msg.error_reply(too_large)]
            if request.request_headers.end_of_stream:
                return [msg.request_headers_reply(self._mutation())]
            if self.mode == BUFFERED:
                return [msg.request_headers_reply()]
            return []  # FULL_DUPLEX: answered with the body
        if kind == "request_body":
            return self._body(request.request_body)
        if kind == "request_trailers":
            if self.mode != BUFFERED and not self.answered:  # the body ended with trailers
                return [*self._answer(end_of_stream=False), msg.trailers_reply(response=False)]
            return [msg.trailers_reply(response=False)]
        if kind == "response_headers":
            return [msg.response_headers_reply()]
        if kind == "response_body":  # only if Envoy was told to send it: pass it through
            body = request.response_body
            if self.mode == BUFFERED:
                return [msg.buffered_body_reply(response=True)]
            return msg.streamed_body_replies(
                body.body, end_of_stream=body.end_of_stream, response=True, size=self.chunk_bytes
            )
        if kind == "response_trailers":
            return [msg.trailers_reply(response=True)]
        return []

    def _mutation(self) -> pb.HeaderMutation:
        if self.model is None:
            return msg.header_mutation(remove=[MODEL_HEADER])
        return msg.header_mutation({MODEL_HEADER: self.model})

    def _body(self, body: pb.HttpBody) -> Replies:
        self.body += body.body
        if len(self.body) > self.max_body_bytes:
            self.done = True
            limit = self.max_body_bytes
            return [msg.error_reply(PayloadTooLarge(f"request body exceeds {limit} bytes"))]
        if not body.end_of_stream:
            return [msg.buffered_body_reply()] if self.mode == BUFFERED else []
        if self.mode == BUFFERED:
            self.model = model_of(bytes(self.body))
            self.answered = True
            return [msg.buffered_body_reply(mutation=self._mutation(), clear_route_cache=True)]
        return self._answer(end_of_stream=True)

    def _answer(self, *, end_of_stream: bool) -> Replies:
        """FULL_DUPLEX: the held headers reply (header set, route cache cleared), then the
        body unchanged."""
        self.model = model_of(bytes(self.body))
        self.answered = True
        headers = msg.request_headers_reply(self._mutation(), clear_route_cache=True)
        body = bytes(self.body)
        return [
            headers,
            *msg.streamed_body_replies(body, end_of_stream=end_of_stream, size=self.chunk_bytes),
        ]


class BbrServicer(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """The gRPC edge: one BbrExchange per stream, replies written in order."""

    def __init__(
        self, *, max_body_bytes: int = 16 << 20, client_header_limits: tuple[int, int] | None = None
    ) -> None:
        self.max_body_bytes = max_body_bytes
        self.client_header_limits = client_header_limits
        self.streams = 0

    async def Process(
        self,
        request_iterator: AsyncIterator[pb.ProcessingRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.ProcessingResponse]:
        exchange = BbrExchange(
            max_body_bytes=self.max_body_bytes, client_header_limits=self.client_header_limits
        )
        self.streams += 1
        async for request in request_iterator:
            for reply in exchange.handle(request):
                yield reply
        log.debug("bbr stream done model=%s", exchange.model)
