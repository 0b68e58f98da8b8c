"""A streamed body's long string is decoded as its chunks come (requestcontrol/splice.py): the
router gets the decoder's own result with the body, and every reply (routing, body, error) is
byte for byte what the same body sent whole gives."""

from __future__ import annotations

import itertools
import json

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from poolkeeper.extproc.contracts import BUFFERED, STREAMED, ExtProcSettings
from poolkeeper.extproc.state import Exchange
from poolkeeper.extproc.wire import BodyChunk, serialize_reply
from poolkeeper.requestcontrol.body import parse_body
from poolkeeper.requestcontrol.types import IncomingRequest, RoutingDecision
from tests.extproc.extproc_fakes import FakeRouter, headers_msg, post_headers

ENVOY_MESSAGE = 262_144


class ParsingRouter(FakeRouter):
    """FakeRouter that first parses the body as the Director does (its errors included)."""

    async def route(self, request: IncomingRequest) -> RoutingDecision:
        parse_body(request.path, request.body, request.decoded)
        return await super().route(request)


async def _run(body: bytes, cuts: list[int], mode: int = STREAMED) -> tuple[object, list[bytes]]:
    router = ParsingRouter()
    exchange = Exchange(router, settings=ExtProcSettings(default_body_mode=mode))
    replies = await exchange.handle(headers_msg(post_headers()))
    edges = [0, *cuts, len(body)]
    for a, b in itertools.pairwise(edges):
        chunk = BodyChunk(memoryview(body)[a:b], b == len(body))
        replies += await exchange.handle(chunk)
    decoded = router.routed[0].decoded if router.routed else "not routed"
    return decoded, [serialize_reply(r) for r in replies]


def _chat(content: str) -> bytes:
    body = {"model": "base", "messages": [{"role": "user", "content": content}], "max_tokens": 1}
    return json.dumps(body).encode()


async def test_the_router_gets_the_decoded_body_and_the_replies_do_not_change() -> None:
    body = _chat("the quick brown fox " * 52_429)
    cuts = list(range(ENVOY_MESSAGE, len(body), ENVOY_MESSAGE))
    decoded, chunked = await _run(body, cuts)
    assert decoded == json.loads(body)
    whole_decoded, whole = await _run(body, [])
    assert whole_decoded is None  # one message: nothing to overlap
    assert chunked == whole
    buffered_decoded, _ = await _run(body, cuts, BUFFERED)
    assert buffered_decoded is None  # BUFFERED bodies are never taken on


@pytest.mark.parametrize("inside", [b"\x01", b"\xff", b"\\ud800", b"\\q", b'"', b"\\"], ids=repr)
async def test_a_bad_long_body_gets_the_same_error_reply(inside: bytes) -> None:
    body = _chat("x" * 700_000)
    at = body.index(b"xxx") + 500_000
    bad = body[:at] + inside + body[at:]
    cuts = list(range(ENVOY_MESSAGE, len(bad), ENVOY_MESSAGE))
    decoded, chunked = await _run(bad, cuts)
    assert decoded == "not routed"
    _, whole = await _run(bad, [])
    assert chunked == whole
    (reply,) = chunked
    assert pb.ProcessingResponse.FromString(reply).immediate_response.status.code == 400


async def test_a_body_ended_by_trailers_keeps_its_decoding() -> None:
    body = _chat("y" * 400_000)
    router = ParsingRouter()
    exchange = Exchange(router, settings=ExtProcSettings(default_body_mode=STREAMED))
    await exchange.handle(headers_msg(post_headers()))
    for a, b in itertools.pairwise([0, 200_000, len(body)]):
        assert await exchange.handle(BodyChunk(memoryview(body)[a:b], False)) == []
    trailers = pb.ProcessingRequest()
    trailers.request_trailers.SetInParent()
    replies = await exchange.handle(trailers)
    assert router.routed[0].decoded == json.loads(body)
    assert len(replies) > 1
    assert not pb.ProcessingResponse.FromString(serialize_reply(replies[0])).HasField(
        "immediate_response"
    )
