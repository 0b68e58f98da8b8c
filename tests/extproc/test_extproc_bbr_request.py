"""The BBR ext_proc exchange (upstream `pkg/bbr/handlers/request_test.go`, v1.0.0): the body's
`model` becomes `x-gateway-model-name` with the route cache cleared; no model, no header (and a
client's copy removed); the body goes back unchanged, in 62,000-byte pieces."""

from __future__ import annotations

import json

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from poolkeeper.extproc.bbr import BUFFERED, MODEL_HEADER, STREAMED, BbrExchange, model_of
from tests.extproc.extproc_fakes import body_msg, headers_msg, post_headers


def _set(reply: pb.ProcessingResponse) -> dict[str, str]:
    common = reply.request_headers.response
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


def _removed(reply: pb.ProcessingResponse) -> list[str]:
    return list(reply.request_headers.response.header_mutation.remove_headers)


def _streamed(replies: list[pb.ProcessingResponse]) -> bytes:
    return b"".join(r.request_body.response.body_mutation.streamed_response.body for r in replies)


def _run(
    body: bytes, *, pieces: int = 1, headers: dict[str, str] | None = None
) -> list[pb.ProcessingResponse]:
    exchange = BbrExchange()
    replies = exchange.handle(headers_msg(post_headers(**(headers or {})), mode=STREAMED))
    assert replies == []  # FULL_DUPLEX: the headers reply waits for the body
    step = max(1, len(body) // pieces)
    parts = [body[i : i + step] for i in range(0, len(body), step)] or [b""]
    for i, part in enumerate(parts):
        replies += exchange.handle(body_msg(part, eos=i == len(parts) - 1))
    return replies


def test_success_with_streaming() -> None:
    body = json.dumps({"model": "foo", "prompt": "x" * 150_000}).encode()
    replies = _run(body, pieces=7)
    head, *rest = replies
    assert head.request_headers.response.clear_route_cache
    assert _set(head) == {MODEL_HEADER: "foo"}
    assert _streamed(rest) == body  # unchanged
    assert len(rest) == 3  # 150 KB in 62,000-byte pieces
    assert [
        r.request_body.response.body_mutation.streamed_response.end_of_stream for r in rest
    ] == [
        False,
        False,
        True,
    ]


@pytest.mark.parametrize(
    "body",
    [b'{"prompt": "no model"}', b'{"model": 3}', b"not json", b'{"model": "a\\nb"}', b""],
    ids=["model-not-found", "model-is-not-string", "invalid-json", "not-a-header-value", "empty"],
)
def test_no_usable_model_sets_no_header(body: bytes) -> None:
    head, *rest = _run(body, headers={MODEL_HEADER: "spoofed"})
    assert _set(head) == {}
    assert _removed(head) == [MODEL_HEADER]  # a client's own copy never survives
    assert _streamed(rest) == body


def test_client_header_is_overwritten() -> None:
    (head, *_) = _run(b'{"model": "real"}', headers={MODEL_HEADER: "spoofed"})
    mutation = head.request_headers.response.header_mutation
    assert _set(head) == {MODEL_HEADER: "real"}
    assert mutation.set_headers[0].append_action == 2  # OVERWRITE_IF_EXISTS_OR_ADD


def test_success_buffered() -> None:
    exchange = BbrExchange()
    (head,) = exchange.handle(headers_msg(post_headers(), mode=BUFFERED))
    assert not head.request_headers.response.HasField("header_mutation")
    (reply,) = exchange.handle(body_msg(b'{"model": "foo"}', eos=True))
    common = reply.request_body.response
    assert common.clear_route_cache
    assert {h.header.key: h.header.raw_value for h in common.header_mutation.set_headers} == {
        MODEL_HEADER: b"foo"
    }
    assert not common.HasField("body_mutation")  # the body passes unchanged


def test_header_only_request_is_answered_at_once() -> None:
    exchange = BbrExchange()
    (head,) = exchange.handle(headers_msg({":method": "GET", MODEL_HEADER: "x"}, eos=True))
    assert _removed(head) == [MODEL_HEADER]


def test_body_ended_by_trailers() -> None:
    exchange = BbrExchange()
    exchange.handle(headers_msg(post_headers(), mode=STREAMED))
    assert exchange.handle(body_msg(b'{"model": "foo"}', eos=False)) == []
    head, body, trailers = exchange.handle(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
    assert _set(head) == {MODEL_HEADER: "foo"}
    assert not body.request_body.response.body_mutation.streamed_response.end_of_stream
    assert trailers.HasField("request_trailers")


def test_oversized_body_is_413() -> None:
    exchange = BbrExchange(max_body_bytes=10)
    exchange.handle(headers_msg(post_headers(), mode=STREAMED))
    (reply,) = exchange.handle(body_msg(b'{"model": "far too long"}', eos=False))
    assert reply.immediate_response.status.code == 413
    assert exchange.handle(body_msg(b"", eos=True)) == []


def test_client_header_limits_are_held_before_the_body() -> None:
    """Behind the BBR bootstrap's codec (room for the routing headers, as serve's) BBR holds
    clients to their own limits: 431 in OpenAI's shape before any body is read. Envoy's own
    headers (x-request-id here) and the request line's pseudo headers count in size only."""
    exchange = BbrExchange(client_header_limits=(3, 1))
    many = post_headers(**{"x-a": "1", "x-b": "2", "x-c": "3"})  # 4 headers of the client's
    (reply,) = exchange.handle(headers_msg(many, mode=STREAMED))
    assert reply.immediate_response.status.code == 431
    error = json.loads(reply.immediate_response.body)["error"]
    assert error["code"] == "request_header_fields_too_large"
    assert exchange.handle(body_msg(b'{"model": "foo"}', eos=True)) == []
    large = post_headers(**{"x-big": "v" * 1024})
    (reply,) = BbrExchange(client_header_limits=(3, 1)).handle(headers_msg(large, mode=STREAMED))
    assert reply.immediate_response.status.code == 431
    within = BbrExchange(client_header_limits=(3, 1))
    assert within.handle(headers_msg(post_headers(**{"x-a": "1", "x-b": "2"}), mode=STREAMED)) == []
    (head, _) = within.handle(body_msg(b'{"model": "foo"}', eos=True))
    assert _set(head) == {MODEL_HEADER: "foo"}


def test_model_of_uses_the_epp_body_rules() -> None:
    assert model_of(b'{"model": "m", "model": "n"}') is None  # duplicate model key rejected
    assert model_of(b'{"model": " padded "}') is None
    assert model_of(b'{"model": "meta-llama/Llama-3.1-8B-Instruct"}') == (
        "meta-llama/Llama-3.1-8B-Instruct"
    )
