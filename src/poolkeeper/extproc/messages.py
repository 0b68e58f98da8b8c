"""Builders for ext_proc ProcessingResponse messages (the replies that route a request are
`routing_replies.py`'s; the readers of ProcessingRequest fields, `request_fields.py`).

Everything the EPP sends to Envoy is built here or there, so the wire shape lives in one place:
header mutations use `raw_value` (what current Envoy sends and expects), the routing decision
travels both as a header and as `dynamic_metadata["envoy.lb"]`, body mutations are split into
chunks of at most 62,000 bytes (some Envoys cap a streamed message at 64 KiB), and errors
become an ImmediateResponse carrying OpenAI error JSON.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from poolkeeper.errors import GatewayError

MAX_BODY_CHUNK = 62_000

OVERWRITE = base_pb2.HeaderValueOption.HeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD


def header_mutation(
    set_headers: Mapping[str, str] | None = None, remove: Iterable[str] = ()
) -> pb.HeaderMutation:
    mutation = pb.HeaderMutation()
    _fill_mutation(mutation, set_headers, remove)
    return mutation


def _fill_mutation(
    mutation: pb.HeaderMutation, set_headers: Mapping[str, str] | None, remove: Iterable[str]
) -> None:
    # Built in place (`add`, then field by field): a message handed to a constructor is
    # copied, and nested constructors copied each header twice, on every routed request.
    if set_headers:
        add = mutation.set_headers.add
        for k, v in set_headers.items():
            header = add(append_action=OVERWRITE).header
            header.key = k
            header.raw_value = v.encode()
    mutation.remove_headers.extend(remove)


def request_headers_reply(
    mutation: pb.HeaderMutation | None = None,
    *,
    clear_route_cache: bool = False,
    metadata: struct_pb2.Struct | None = None,
) -> pb.ProcessingResponse:
    # Outside in, so the mutation is copied once (nested constructors copied it three times).
    reply = pb.ProcessingResponse()
    common = reply.request_headers.response
    common.SetInParent()
    if clear_route_cache:
        common.clear_route_cache = True
    if mutation is not None:
        common.header_mutation.CopyFrom(mutation)
    if metadata is not None:
        reply.dynamic_metadata.CopyFrom(metadata)
    return reply


def response_headers_reply(mutation: pb.HeaderMutation | None = None) -> pb.ProcessingResponse:
    common = pb.CommonResponse()
    if mutation is not None:
        common.header_mutation.CopyFrom(mutation)
    return pb.ProcessingResponse(response_headers=pb.HeadersResponse(response=common))


def chunks(body: bytes, size: int = MAX_BODY_CHUNK) -> Iterator[bytes]:
    """`body` in pieces of at most `size` bytes; an empty body is one empty piece."""
    if not body:
        yield b""
        return
    for start in range(0, len(body), size):
        yield body[start : start + size]


def streamed_body_replies(
    body: bytes, *, end_of_stream: bool, response: bool = False, size: int = MAX_BODY_CHUNK
) -> list[pb.ProcessingResponse]:
    """FULL_DUPLEX_STREAMED body mutations; only the last chunk carries `end_of_stream`.

    Each reply is built from the outside in and its piece set once: a message passed to a
    parent's constructor is copied, so nesting constructors copied each piece five times
    (2.4 ms of CPU for a 1 MiB body, now 0.5 ms)."""
    total = len(body)
    if 0 < total <= size and type(body) is bytes:
        # One piece (every small request): the body itself, with no view, slice or copy.
        reply = pb.ProcessingResponse()
        part = reply.response_body if response else reply.request_body
        streamed = part.response.body_mutation.streamed_response
        streamed.body = body
        streamed.end_of_stream = end_of_stream
        return [reply]
    view = memoryview(body)
    starts = range(0, total, size) if total else range(1)
    last = starts[-1]
    replies = []
    for start in starts:
        reply = pb.ProcessingResponse()
        part = reply.response_body if response else reply.request_body
        streamed = part.response.body_mutation.streamed_response
        streamed.body = bytes(view[start : start + size])
        streamed.end_of_stream = end_of_stream and start == last
        replies.append(reply)
    return replies


def buffered_body_reply(
    *,
    body: bytes | None = None,
    mutation: pb.HeaderMutation | None = None,
    clear_route_cache: bool = False,
    metadata: struct_pb2.Struct | None = None,
    response: bool = False,
) -> pb.ProcessingResponse:
    """A BUFFERED-mode body reply: optional header mutation and whole-body replacement."""
    common = pb.CommonResponse(clear_route_cache=clear_route_cache)
    if mutation is not None:
        common.header_mutation.CopyFrom(mutation)
    if body is not None:
        common.body_mutation.CopyFrom(pb.BodyMutation(body=body))
    reply = _body_reply(common, response)
    if metadata is not None:
        reply.dynamic_metadata.CopyFrom(metadata)
    return reply


def _body_reply(common: pb.CommonResponse, response: bool) -> pb.ProcessingResponse:
    body = pb.BodyResponse(response=common)
    if response:
        return pb.ProcessingResponse(response_body=body)
    return pb.ProcessingResponse(request_body=body)


def trailers_reply(*, response: bool) -> pb.ProcessingResponse:
    if response:
        return pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
    return pb.ProcessingResponse(request_trailers=pb.TrailersResponse())


DROPPED_REASON_HEADER = "x-llm-d-request-dropped-reason"
CONFORMANCE_SERVED_HEADER = "x-conformance-test-served-endpoint"


def immediate_reply(
    status: int,
    body: bytes,
    *,
    content_type: str = "application/json",
    details: str = "",
    headers: dict[str, str] | None = None,
) -> pb.ProcessingResponse:
    reply = pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=header_mutation({"content-type": content_type, **(headers or {})}),
            body=body,
            details=details,
        )
    )
    return reply


def error_reply(error: GatewayError) -> pb.ProcessingResponse:
    """ImmediateResponse with the error's HTTP status and its OpenAI error JSON."""
    body = json.dumps(error.openai_body(), separators=(",", ":")).encode()
    reason = {DROPPED_REASON_HEADER: error.dropped_reason} if error.dropped_reason else None
    return immediate_reply(error.http_status, body, details=error.code, headers=reason)


def models_reply(model_names: Iterable[str]) -> pb.ProcessingResponse:
    """`GET /v1/models` answered by the EPP itself, in the OpenAI list shape."""
    data = [
        {"id": name, "object": "model", "created": 0, "owned_by": "poolkeeper"}
        for name in sorted(set(model_names))
    ]
    body = json.dumps({"object": "list", "data": data}, separators=(",", ":")).encode()
    return immediate_reply(200, body)
