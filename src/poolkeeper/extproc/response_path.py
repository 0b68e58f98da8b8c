"""The response half of an exchange (`ResponsePath`, on `exchange_state.ExchangeState`):
response headers (status, the served endpoint, which body filter applies: SSE usage and model
name, or a JSON body held for its model name; the conformance served header), response body
chunks (first byte, usage capture, the rewrites) and what is still held when trailers end it.
"""

from __future__ import annotations

import logging

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from poolkeeper.extproc import messages as msg, request_fields, wire
from poolkeeper.extproc.contracts import BUFFERED
from poolkeeper.extproc.exchange_state import ExchangeState, Phase, Replies
from poolkeeper.extproc.model_name import rewriter_for
from poolkeeper.extproc.usage import SseUsageFilter

log = logging.getLogger("poolkeeper.extproc")


class ResponsePath(ExchangeState):
    """The response half of one exchange (`state.Exchange` dispatches to it)."""

    def _response_headers(self, headers: pb.HttpHeaders) -> Replies:
        self.phase = Phase.RESPONSE
        values = request_fields.header_map(headers)
        try:
            self.status = int(values.get(":status", "0"))
        except ValueError:
            self.status = 0
        self.served = values.get(request_fields.SERVED_KEY) or self.served
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
