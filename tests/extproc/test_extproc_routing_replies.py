"""The routing a reply carries has one home (`routing_replies._fill_routing`):
FULL_DUPLEX_STREAMED puts it on the request-headers reply (`routing_reply`), BUFFERED on the
request-body reply (`buffered_routing_reply`). Both must stay the exact bytes the separate
builders made (map entries in sorted order: the default serialization orders them by hash)."""

from __future__ import annotations

import itertools

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from poolkeeper import observation
from poolkeeper.extproc import messages as msg, request_fields, routing_replies

ENDPOINTS = [("10.0.0.1:8000",), ("10.0.0.1:8000", "10.0.0.2:8000", "[fd00::3]:8000")]
BODIES = [None, b"", b'{"model":"adapter-1","messages":[]}', bytes(range(256)) * 300]
SPOOFED = [
    [],
    [routing_replies.DESTINATION_HEADER, "x-gateway-model-name-rewrite"],
    ["content-length"],
]
KEYS = [(None, False), ("k1", False), ("k2", True)]


def _buffered_by_parts(
    endpoints: tuple[str, ...], body: bytes | None, spoofed: list[str], key: str | None, via: bool
) -> pb.ProcessingResponse:
    """The BUFFERED routing reply as `Exchange` built it before: each part apart, copied in."""
    metadata = routing_replies.destination_metadata(endpoints)
    if key is not None:
        routing_replies.add_exchange_key(metadata, key, via_epp=via)
    length = len(body) if body is not None else None
    mutation = routing_replies.routing_headers(endpoints, length, spoofed)
    return msg.buffered_body_reply(
        body=body, mutation=mutation, clear_route_cache=True, metadata=metadata
    )


def test_the_buffered_routing_reply_is_the_bytes_the_parts_made() -> None:
    cases = itertools.product(ENDPOINTS, BODIES, SPOOFED, KEYS)
    for endpoints, body, spoofed, (key, via) in cases:
        built = routing_replies.buffered_routing_reply(endpoints, body, spoofed, key, via_epp=via)
        reference = _buffered_by_parts(endpoints, body, spoofed, key, via)
        # Deterministic: map entries (the metadata's namespaces) are sorted, where the default
        # serialization follows the hash table's order, which varies between runs.
        assert built.SerializeToString(deterministic=True) == reference.SerializeToString(
            deterministic=True
        ), (endpoints, body, key)
        assert built == reference


def test_both_modes_route_with_the_same_parts() -> None:
    """Header mutation, route-cache clear and metadata are the same on either reply."""
    cases = itertools.product(ENDPOINTS, BODIES, SPOOFED, KEYS)
    for endpoints, body, spoofed, (key, via) in cases:
        length = len(body) if body is not None else None
        streamed = routing_replies.routing_reply(endpoints, length, spoofed, key, via_epp=via)
        buffered = routing_replies.buffered_routing_reply(
            endpoints, body, spoofed, key, via_epp=via
        )
        on_headers, on_body = streamed.request_headers.response, buffered.request_body.response
        assert on_headers.header_mutation == on_body.header_mutation
        assert on_headers.clear_route_cache
        assert on_body.clear_route_cache
        assert streamed.dynamic_metadata == buffered.dynamic_metadata
        assert on_body.HasField("body_mutation") == (body is not None)
        assert not on_headers.HasField("body_mutation")


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.HeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def test_the_routing_reply_is_the_bytes_plain_constructors_make() -> None:
    """Against a reference built from protobuf constructors alone (no builder of messages.py):
    the destination header, Content-Length, the client's copies of anything else removed."""
    cases = itertools.product(ENDPOINTS, BODIES, SPOOFED, KEYS)
    for endpoints, body, spoofed, (key, via) in cases:
        length = len(body) if body is not None else None
        destination = ",".join(endpoints)
        sets = [_header(routing_replies.DESTINATION_HEADER, destination)]
        if length is not None:
            sets.append(_header("content-length", str(length)))
        names = {routing_replies.DESTINATION_HEADER} | (
            {"content-length"} if length is not None else set()
        )
        mutation = pb.HeaderMutation(
            set_headers=sets, remove_headers=[h for h in spoofed if h not in names]
        )
        lb = {routing_replies.DESTINATION_HEADER: destination}
        metadata = struct_pb2.Struct()
        metadata.update({routing_replies.LB_NAMESPACE: lb})
        if key is not None:
            names_ = {observation.EXCHANGE: key}
            if via:
                names_[observation.RESPONSE_PATH] = observation.VIA_EPP
            metadata.update({observation.NAMESPACE: names_})
        reference = pb.ProcessingResponse(
            request_headers=pb.HeadersResponse(
                response=pb.CommonResponse(header_mutation=mutation, clear_route_cache=True)
            ),
            dynamic_metadata=metadata,
        )
        built = routing_replies.routing_reply(endpoints, length, spoofed, key, via_epp=via)
        assert built.SerializeToString(deterministic=True) == reference.SerializeToString(
            deterministic=True
        ), (endpoints, body, spoofed, key)


def test_every_gateway_header_is_found_by_the_quick_check() -> None:
    for name in [
        *request_fields.CONTROL_HEADERS,
        routing_replies.DESTINATION_HEADER,
        request_fields.SERVED_KEY,
        request_fields.SUBSET_KEY,
    ]:
        assert request_fields.may_name_gateway_headers({"accept": "*/*", name: "x"}), name
        assert request_fields.may_name_gateway_headers({name: "x"}), name
    assert not request_fields.may_name_gateway_headers(
        {"accept": "*/*", "x-gatewa": "x", "a-x-gateway-": ""}
    )
    assert not request_fields.may_name_gateway_headers({})


def test_the_prebuilt_routing_reply_is_the_built_one() -> None:
    """`routing_reply`'s copy of a prebuilt reply against the same reply built field by field,
    over shapes that take the copy and shapes that do not."""
    lengths = [None, 0, 7, 62_000, 1 << 20]
    cases = itertools.product(ENDPOINTS, lengths, SPOOFED, KEYS)
    for endpoints, length, spoofed, (key, via) in cases:
        quick = routing_replies.routing_reply(endpoints, length, spoofed, key, via_epp=via)
        built = routing_replies.built_routing_reply(endpoints, length, spoofed, key, via_epp=via)
        assert quick == built, (endpoints, length, spoofed, key, via)
        assert quick.SerializeToString(deterministic=True) == built.SerializeToString(
            deterministic=True
        )
    # the template itself is never handed out: each reply is its own message
    one = routing_replies.routing_reply(ENDPOINTS[0], 5, [], "k1")
    two = routing_replies.routing_reply(ENDPOINTS[1], 6, [], "k2")
    assert one != two
    assert (
        one.dynamic_metadata.fields[observation.NAMESPACE]
        .struct_value.fields[observation.EXCHANGE]
        .string_value
        == "k1"
    )
