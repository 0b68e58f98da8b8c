"""ext_proc wire behaviour, driven by a gRPC client that behaves like Envoy (gie.md §7.2)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from poolkeeper.extproc.contracts import ExtProcSettings
from poolkeeper.extproc.server import ExtProcServicer
from poolkeeper.extproc.state import Exchange
from poolkeeper.requestcontrol.types import Usage
from tests.extproc.extproc_fakes import (
    BUFFERED,
    PODS,
    STREAMED,
    FakeEnvoy,
    FakeRouter,
    body_msg,
    headers_msg,
    post_headers,
    serving,
)

DEST = "x-gateway-destination-endpoint"


@pytest.fixture
def router() -> FakeRouter:
    return FakeRouter()


@pytest.fixture
def ended() -> list[Exchange]:
    """Exchanges whose gRPC stream has ended, appended after their `close()` ran."""
    return []


@contextlib.asynccontextmanager
async def _serving(
    router: FakeRouter, ended: list[Exchange], settings: ExtProcSettings, transport: str
) -> AsyncIterator[FakeEnvoy]:
    servicer = ExtProcServicer(router, settings=settings, on_stream_end=ended.append)
    async with serving(transport, servicer) as port:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        try:
            yield FakeEnvoy(channel)
        finally:
            await channel.close()


@pytest.fixture
async def envoy(
    router: FakeRouter, ended: list[Exchange], transport: str
) -> AsyncIterator[FakeEnvoy]:
    settings = ExtProcSettings(body_chunk_bytes=62_000)
    async with _serving(router, ended, settings, transport) as envoy:
        yield envoy


async def _until(condition: Callable[[], object], polls: int = 2000) -> None:
    """Polls `condition` every 5 ms until it is true; the bound (10 s) only ends a failing test."""
    for _ in range(polls):
        if condition():
            return
        await asyncio.sleep(0.005)


def _set_headers(mutation: pb.HeaderMutation) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


def _dest_metadata(reply: pb.ProcessingResponse) -> dict[str, str]:
    lb = reply.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    return {k: v.string_value for k, v in lb.items()}


async def _read(call: grpc.aio.StreamStreamCall, n: int) -> list[pb.ProcessingResponse]:
    return [await asyncio.wait_for(call.read(), 5) for _ in range(n)]


async def _streamed_request(
    envoy: FakeEnvoy,
    body: bytes,
    *,
    piece: int,
    hint: list[str] | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[grpc.aio.StreamStreamCall, list[pb.ProcessingResponse]]:
    """Sends headers + body in `piece`-byte chunks; returns every reply up to the body's end."""
    call = envoy.open()
    await call.write(headers_msg(post_headers(**(headers or {})), mode=STREAMED, hint=hint))
    pieces = [body[i : i + piece] for i in range(0, len(body), piece)] or [b""]
    for i, p in enumerate(pieces):
        await call.write(body_msg(p, eos=i == len(pieces) - 1))
    first = await asyncio.wait_for(call.read(), 5)
    replies = [first]
    if first.WhichOneof("response") == "request_headers":
        while True:
            reply = await asyncio.wait_for(call.read(), 5)
            replies.append(reply)
            if reply.request_body.response.body_mutation.streamed_response.end_of_stream:
                break
    return call, replies


def _body_of(replies: list[pb.ProcessingResponse]) -> bytes:
    return b"".join(
        r.request_body.response.body_mutation.streamed_response.body
        for r in replies
        if r.WhichOneof("response") == "request_body"
    )


CHAT = json.dumps(
    {"model": "split", "messages": [{"role": "user", "content": "hi there"}]}
).encode()


@pytest.mark.parametrize("piece", [1, 7, len(CHAT)])
async def test_streamed_body_any_chunking_same_decision(
    envoy: FakeEnvoy, router: FakeRouter, piece: int
) -> None:
    call, replies = await _streamed_request(envoy, CHAT, piece=piece)
    head = replies[0]
    assert head.WhichOneof("response") == "request_headers"
    common = head.request_headers.response
    assert common.clear_route_cache
    headers = _set_headers(common.header_mutation)
    # Protocol v0.4+: primary then fallbacks, comma-separated, in the one key.
    assert headers[DEST] == ",".join(PODS)
    body = _body_of(replies)
    assert headers["content-length"] == str(len(body))
    assert json.loads(body)["model"] == "adapter-1"
    meta = _dest_metadata(head)
    assert meta == {DEST: headers[DEST]}  # header and metadata never differ; no -fallback key
    assert router.routed[-1].body == CHAT
    call.cancel()


async def test_large_body_is_sent_back_in_chunks_of_at_most_62000(envoy: FakeEnvoy) -> None:
    content = "x" * 200_000
    body = json.dumps({"model": "split", "prompt": content}).encode()
    call, replies = await _streamed_request(envoy, body, piece=16_384)
    chunks = [r for r in replies if r.WhichOneof("response") == "request_body"]
    sizes = [len(r.request_body.response.body_mutation.streamed_response.body) for r in chunks]
    assert len(chunks) == 4
    assert max(sizes) <= 62_000
    eos = [r.request_body.response.body_mutation.streamed_response.end_of_stream for r in chunks]
    assert eos == [False, False, False, True]
    assert json.loads(_body_of(replies))["prompt"] == content
    call.cancel()


async def test_buffered_mode_answers_every_message(envoy: FakeEnvoy, router: FakeRouter) -> None:
    call = envoy.open()
    await call.write(headers_msg(post_headers(), mode=BUFFERED))
    (head,) = await _read(call, 1)
    assert head.WhichOneof("response") == "request_headers"
    await call.write(body_msg(CHAT, eos=True))
    (body,) = await _read(call, 1)
    common = body.request_body.response
    assert common.clear_route_cache
    assert _set_headers(common.header_mutation)[DEST] == ",".join(PODS)
    assert json.loads(common.body_mutation.body)["model"] == "adapter-1"
    assert _set_headers(common.header_mutation)["content-length"] == str(
        len(common.body_mutation.body)
    )
    assert _dest_metadata(body)[DEST] == ",".join(PODS)
    call.cancel()


async def test_buffered_unchanged_body_is_not_mutated(envoy: FakeEnvoy) -> None:
    call = envoy.open()
    await call.write(headers_msg(post_headers(), mode=BUFFERED))
    await _read(call, 1)
    await call.write(body_msg(json.dumps({"model": "base"}).encode(), eos=True))
    (body,) = await _read(call, 1)
    common = body.request_body.response
    assert not common.HasField("body_mutation")
    assert "content-length" not in _set_headers(common.header_mutation)
    call.cancel()


@pytest.mark.parametrize(
    ("hint", "expected"),
    [
        ([PODS[1], PODS[2]], PODS[1]),
        ([], None),
        (["192.168.9.9:8000"], None),
    ],
)
async def test_subset_hint(envoy: FakeEnvoy, hint: list[str], expected: str | None) -> None:
    body = json.dumps({"model": "base"}).encode()
    call, replies = await _streamed_request(envoy, body, piece=len(body), hint=hint)
    if expected is None:
        assert replies[0].immediate_response.status.code == 503
    else:
        value = _set_headers(replies[0].request_headers.response.header_mutation)[DEST]
        assert value.split(",")[0] == expected
        assert set(value.split(",")) <= set(hint)
        assert _dest_metadata(replies[0])[DEST] == value
    call.cancel()


@pytest.mark.parametrize(
    ("body", "status", "type_"),
    [
        (b"{not json", 400, "invalid_request_error"),
        (b'{"messages": []}', 400, "invalid_request_error"),
        (b'{"model": 7}', 400, "invalid_request_error"),
        (b'{"model": "nope"}', 404, "invalid_request_error"),
        (b'{"model": "shed"}', 429, "rate_limit_error"),
    ],
)
async def test_errors_are_immediate_openai_responses(
    envoy: FakeEnvoy, router: FakeRouter, body: bytes, status: int, type_: str
) -> None:
    call, replies = await _streamed_request(envoy, body, piece=3)
    (reply,) = replies
    imm = reply.immediate_response
    assert imm.status.code == status
    err = json.loads(imm.body)["error"]
    assert err["type"] == type_
    assert set(err) == {"message", "type", "param", "code"}
    assert _set_headers(imm.headers)["content-type"] == "application/json"
    call.cancel()
    assert router.completed == []  # nothing was admitted, so nothing to release


async def test_an_immediate_response_ends_the_stream_at_once(
    envoy: FakeEnvoy, router: FakeRouter
) -> None:
    """After an ImmediateResponse the EPP ends the stream itself (status OK) instead of
    waiting for Envoy to close or reset it: a read left pending at Envoy's reset leaks native
    memory in grpc.aio (grpc/grpc#43360; checklist G3)."""
    call, (reply,) = await _streamed_request(envoy, b'{"model": "nope"}', piece=5)
    assert reply.immediate_response.status.code == 404
    assert await asyncio.wait_for(call.code(), 5) == grpc.StatusCode.OK  # we never half-closed


async def test_no_pods_gives_503(envoy: FakeEnvoy, router: FakeRouter) -> None:
    router.pods = ()
    call, (reply,) = await _streamed_request(envoy, b'{"model": "base"}', piece=4)
    assert reply.immediate_response.status.code == 503
    assert json.loads(reply.immediate_response.body)["error"]["type"] == (
        "service_unavailable_error"
    )
    call.cancel()


async def test_header_only_request_is_routed_at_once(envoy: FakeEnvoy, router: FakeRouter) -> None:
    call = envoy.open()
    await call.write(headers_msg({":method": "GET", ":path": "/health"}, eos=True))
    (reply,) = await _read(call, 1)
    common = reply.request_headers.response
    assert _set_headers(common.header_mutation)[DEST] == PODS[0]
    assert "content-length" not in _set_headers(common.header_mutation)
    assert common.clear_route_cache
    assert router.routed[-1].body == b""
    call.cancel()


async def test_models_listing_goes_to_a_model_server(envoy: FakeEnvoy, router: FakeRouter) -> None:
    """As upstream's gateways: a body-less request like any other (requestHandling default)."""
    call = envoy.open()
    await call.write(headers_msg({":method": "GET", ":path": "/v1/models?x=1"}, eos=True))
    (reply,) = await _read(call, 1)
    assert _set_headers(reply.request_headers.response.header_mutation)[DEST] == PODS[0]
    assert [r.path for r in router.routed] == ["/v1/models?x=1"]
    call.cancel()


async def test_models_listing_answered_by_the_epp_when_asked(
    router: FakeRouter, ended: list[Exchange], transport: str
) -> None:
    async with _serving(router, ended, ExtProcSettings(answer_models=True), transport) as envoy:
        call = envoy.open()
        await call.write(headers_msg({":method": "GET", ":path": "/v1/models?x=1"}, eos=True))
        (reply,) = await _read(call, 1)
        assert reply.immediate_response.status.code == 200
        listing = json.loads(reply.immediate_response.body)
        assert listing["object"] == "list"
        assert [m["id"] for m in listing["data"]] == ["base", "split"]
        assert router.routed == []
        call.cancel()


async def test_client_header_limits_are_checked_before_routing(
    router: FakeRouter, ended: list[Exchange], transport: str
) -> None:
    """More client headers (or bytes) than allowed: 431 in OpenAI's shape before routing.
    Envoy's own additions do not count; the request line counts in bytes only."""
    settings = ExtProcSettings(client_header_limits=(8, 1))
    envoy_added = {"x-forwarded-for": "1.2.3.4", "x-forwarded-proto": "http",
                   "x-envoy-external-address": "1.2.3.4"}  # fmt: skip
    mine = {f"x-h{i}": "v" for i in range(4)}  # 4 + content-type + x-request-id (Envoy's)
    async with _serving(router, ended, settings, transport) as envoy:
        for extra, refused in (
            ({**mine, **envoy_added}, False),  # 5 client headers: within 8
            ({**mine, "x-h4": "v", "x-h5": "v", "x-h6": "v", "x-h7": "v"}, True),  # 9
            ({"x-big": "v" * 1000}, True),  # 1,000 bytes of value + the request line > 1 KiB
            # 8 + a client's own x-gateway-model-name (serve's Envoy does not strip it): 9
            ({**mine, "x-h4": "v", "x-h5": "v", "x-h6": "v", "x-gateway-model-name": "m"}, True),
        ):
            call = envoy.open()
            await call.write(headers_msg(post_headers(**extra), eos=True))
            (reply,) = await _read(call, 1)
            if refused:
                assert reply.immediate_response.status.code == 431, extra.keys()
                error = json.loads(reply.immediate_response.body)["error"]
                assert error["code"] == "request_header_fields_too_large"
                assert "at most 8 headers and 1 KiB" in error["message"]
            else:
                assert reply.WhichOneof("response") == "request_headers", extra.keys()
            call.cancel()
        long_url = headers_msg({**post_headers(), ":path": "/v1/chat/completions?q=" + "a" * 1000})
        call = envoy.open()
        await call.write(long_url)
        (reply,) = await _read(call, 1)
        assert reply.immediate_response.status.code == 431
        call.cancel()
    assert len(router.routed) == 1  # only the request within the limits


async def test_client_routing_headers_are_stripped(envoy: FakeEnvoy, router: FakeRouter) -> None:
    spoof = {
        DEST: "169.254.169.254:80",
        "x-gateway-destination-endpoint-served": "1.2.3.4:1",
        "x-gateway-destination-endpoint-subset": "1.2.3.4:1",
    }
    call, replies = await _streamed_request(envoy, b'{"model": "base"}', piece=100, headers=spoof)
    mutation = replies[0].request_headers.response.header_mutation
    assert _set_headers(mutation)[DEST] == ",".join(PODS)
    assert set(mutation.remove_headers) == {
        "x-gateway-destination-endpoint-served",
        "x-gateway-destination-endpoint-subset",
    }
    assert not any(h.startswith(DEST) for h in router.routed[-1].headers)
    call.cancel()


async def test_control_headers_reach_the_router_not_the_server(
    envoy: FakeEnvoy, router: FakeRouter
) -> None:
    """Upstream v1.x `handlers/request.go`: the objective and rewrite headers are read by the
    EPP (which honours them only when trusted) and removed before the request goes upstream."""
    control = {
        "x-gateway-inference-objective": "gold",
        "x-gateway-model-name-rewrite": "other",
        "x-gateway-inference-fairness-id": "tenant-a",
    }
    call, replies = await _streamed_request(envoy, b'{"model": "base"}', piece=100, headers=control)
    mutation = replies[0].request_headers.response.header_mutation
    assert set(mutation.remove_headers) == set(control)
    assert {k: router.routed[-1].headers[k] for k in control} == control
    call.cancel()


def _sse(*events: object) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)


USAGE_EVENT = {"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 3}}
CONTENT_EVENT = {"choices": [{"index": 0, "delta": {"content": "hey"}}]}


@pytest.mark.parametrize("client_asked", [False, True])
async def test_sse_usage_counted_and_injected_chunk_stripped(
    envoy: FakeEnvoy, router: FakeRouter, client_asked: bool
) -> None:
    req: dict[str, object] = {"model": "base", "stream": True}
    if client_asked:
        req["stream_options"] = {"include_usage": True}
    call, replies = await _streamed_request(envoy, json.dumps(req).encode(), piece=5)
    sent = json.loads(_body_of(replies))
    assert sent["stream_options"] == {"include_usage": True}
    stream = _sse(CONTENT_EVENT, USAGE_EVENT) + b"data: [DONE]\n\n"
    await call.write(
        headers_msg(
            {
                ":status": "200",
                "content-type": "text/event-stream",
                "x-gateway-destination-endpoint-served": PODS[0],
            },
            response=True,
        )
    )
    (head,) = await _read(call, 1)
    assert head.WhichOneof("response") == "response_headers"
    forwarded = b""
    pieces = [stream[i : i + 9] for i in range(0, len(stream), 9)]
    for i, p in enumerate(pieces):
        await call.write(body_msg(p, eos=i == len(pieces) - 1, response=True))
        (reply,) = await _read(call, 1)  # exactly one reply per response chunk, in order
        streamed = reply.response_body.response.body_mutation.streamed_response
        assert streamed.end_of_stream == (i == len(pieces) - 1)
        forwarded += streamed.body
    expected = stream if client_asked else _sse(CONTENT_EVENT) + b"data: [DONE]\n\n"
    assert forwarded == expected
    await call.done_writing()
    decision, status, usage, served = router.completed[-1]
    assert (status, usage, served) == (200, Usage(11, 3), PODS[0])
    assert decision.include_usage_injected is not client_asked
    assert len(router.completed) == 1


async def test_json_response_usage_and_trailers(envoy: FakeEnvoy, router: FakeRouter) -> None:
    call, _ = await _streamed_request(envoy, b'{"model": "base"}', piece=100)
    await call.write(
        headers_msg({":status": "200", "content-type": "application/json"}, response=True)
    )
    await _read(call, 1)
    body = json.dumps({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 9}})
    await call.write(body_msg(body[:10].encode(), eos=False, response=True))
    await call.write(body_msg(body[10:].encode(), eos=False, response=True))
    await call.write(pb.ProcessingRequest(response_trailers=pb.HttpTrailers()))
    replies = await _read(call, 3)
    kinds = [r.WhichOneof("response") for r in replies]
    assert kinds == ["response_body", "response_body", "response_trailers"]
    assert (
        b"".join(r.response_body.response.body_mutation.streamed_response.body for r in replies[:2])
        == body.encode()
    )
    assert router.completed[-1][1:3] == (200, Usage(4, 9))
    call.cancel()


async def test_error_status_from_model_server_is_recorded(
    envoy: FakeEnvoy, router: FakeRouter
) -> None:
    call, _ = await _streamed_request(envoy, b'{"model": "base"}', piece=100)
    await call.write(headers_msg({":status": "500"}, response=True, eos=True))
    await _read(call, 1)
    assert router.completed[-1][1] == 500
    call.cancel()


async def test_cancel_after_routing_releases_once(
    envoy: FakeEnvoy, router: FakeRouter, ended: list[Exchange]
) -> None:
    call, _ = await _streamed_request(envoy, b'{"model": "base"}', piece=100)
    assert router.completed == []  # routed, not yet released
    call.cancel()
    # Wait for the end of the server's stream handling (after `close()`), not for the first
    # release: a second release would come before this point and be counted below.
    await _until(lambda: ended)
    assert len(ended) == 1
    assert [c[1] for c in router.completed] == [499]


async def test_finished_response_is_released_once_when_the_stream_ends(
    envoy: FakeEnvoy, router: FakeRouter, ended: list[Exchange]
) -> None:
    call, _ = await _streamed_request(envoy, b'{"model": "base"}', piece=100)
    await call.write(headers_msg({":status": "200"}, response=True, eos=True))
    await _read(call, 1)
    assert [c[1] for c in router.completed] == [200]  # released when the response ended
    await call.done_writing()
    await _until(lambda: ended)
    assert len(ended) == 1
    assert [c[1] for c in router.completed] == [200]  # and not again by close()


async def test_cancel_while_routing_cancels_the_router(
    envoy: FakeEnvoy, router: FakeRouter
) -> None:
    call = envoy.open()
    await call.write(headers_msg(post_headers(), mode=STREAMED))
    await call.write(body_msg(b'{"model": "slow"}', eos=True))
    for _ in range(100):
        if router.routed:
            break
        await asyncio.sleep(0.01)
    call.cancel()
    for _ in range(200):
        if router.cancelled:
            break
        await asyncio.sleep(0.01)
    assert router.cancelled == 1
    assert router.completed == []


async def test_many_streams_in_parallel_keep_their_own_state(
    envoy: FakeEnvoy, router: FakeRouter
) -> None:
    async def one(i: int) -> int:
        body = json.dumps({"model": "base", "i": i}).encode()
        call, replies = await _streamed_request(
            envoy, body, piece=3, headers={"x-request-id": f"r{i}"}
        )
        call.cancel()
        return json.loads(_body_of(replies))["i"]  # type: ignore[no-any-return]

    results = await asyncio.gather(*(one(i) for i in range(30)))
    assert results == list(range(30))
    assert sorted(r.request_id for r in router.routed) == sorted(f"r{i}" for i in range(30))


async def test_logs_never_contain_the_prompt(
    envoy: FakeEnvoy, router: FakeRouter, caplog: pytest.LogCaptureFixture
) -> None:
    canary = "CANARY-PII-4242"
    caplog.set_level("DEBUG", logger="poolkeeper")
    for body in (
        json.dumps({"model": "base", "messages": [{"role": "user", "content": canary}]}),
        json.dumps({"model": "nope", "prompt": canary}),
        "{" + canary,
    ):
        call, _ = await _streamed_request(envoy, body.encode(), piece=50)
        call.cancel()
    assert caplog.records  # routing and rejections were logged
    assert canary not in caplog.text


async def test_served_fallback_moves_accounting(envoy: FakeEnvoy, router: FakeRouter) -> None:
    call, _ = await _streamed_request(envoy, b'{"model": "base"}', piece=100)
    served = {":status": "200", "x-gateway-destination-endpoint-served": PODS[2]}
    await call.write(headers_msg(served, response=True, eos=True))
    await _read(call, 1)
    assert router.moved == [("req-1", PODS[2])]
    assert router.completed[-1][3] == PODS[2]
    call.cancel()


async def test_json_response_over_chunks_with_empty_final_chunk(
    envoy: FakeEnvoy, router: FakeRouter
) -> None:
    call, _ = await _streamed_request(envoy, b'{"model": "base"}', piece=100)
    await call.write(
        headers_msg({":status": "200", "content-type": "application/json"}, response=True)
    )
    await _read(call, 1)
    body = json.dumps({"usage": {"prompt_tokens": 2, "completion_tokens": 5}}).encode()
    pieces = [body[:7], body[7:], b""]
    forwarded = b""
    for i, piece in enumerate(pieces):
        await call.write(body_msg(piece, eos=i == 2, response=True))
        (reply,) = await _read(call, 1)
        streamed = reply.response_body.response.body_mutation.streamed_response
        assert streamed.end_of_stream == (i == 2)
        forwarded += streamed.body
    assert forwarded == body
    assert router.completed[-1][1:3] == (200, Usage(2, 5))
    call.cancel()


async def test_empty_body_message_still_gets_a_body_reply(
    envoy: FakeEnvoy, router: FakeRouter
) -> None:
    # POST whose body turns out empty: headers without end_of_stream, then an empty final chunk.
    # Envoy waits for the body in FULL_DUPLEX, so the EPP must answer it (not only the headers).
    call = envoy.open()
    await call.write(headers_msg({":method": "POST", ":path": "/x"}, mode=STREAMED))
    await call.write(body_msg(b"", eos=True))
    head, body = await _read(call, 2)
    assert _set_headers(head.request_headers.response.header_mutation)[DEST] == PODS[0]
    streamed = body.request_body.response.body_mutation.streamed_response
    assert streamed.end_of_stream
    assert streamed.body == b""
    call.cancel()


async def test_json_response_carries_the_client_model_name(
    envoy: FakeEnvoy, router: FakeRouter
) -> None:
    """`split` is sent to `adapter-1`; the client gets `split` back (upstream v1.x does too)."""
    call, _ = await _streamed_request(envoy, b'{"model": "split"}', piece=100)
    await call.write(
        headers_msg(
            {":status": "200", "content-type": "application/json", "content-length": "99"},
            response=True,
        )
    )
    (head,) = await _read(call, 1)
    removed = head.response_headers.response.header_mutation.remove_headers
    assert list(removed) == ["content-length"]
    body = json.dumps({"model": "adapter-1", "usage": {"prompt_tokens": 2, "completion_tokens": 5}})
    pieces = [body[:13].encode(), body[13:].encode()]  # the name is split across chunks
    forwarded = b""
    for i, piece in enumerate(pieces):
        await call.write(body_msg(piece, eos=i == 1, response=True))
        (reply,) = await _read(call, 1)
        forwarded += reply.response_body.response.body_mutation.streamed_response.body
    assert json.loads(forwarded)["model"] == "split"
    assert router.completed[-1][1:3] == (200, Usage(2, 5))
    call.cancel()


async def test_sse_response_carries_the_client_model_name(
    envoy: FakeEnvoy, router: FakeRouter
) -> None:
    req = {"model": "split", "stream": True, "stream_options": {"include_usage": True}}
    call, _ = await _streamed_request(envoy, json.dumps(req).encode(), piece=100)
    await call.write(
        headers_msg({":status": "200", "content-type": "text/event-stream"}, response=True)
    )
    await _read(call, 1)
    stream = _sse({"model": "adapter-1", **CONTENT_EVENT}, {"model": "adapter-1", **USAGE_EVENT})
    stream += b"data: [DONE]\n\n"
    forwarded = b""
    pieces = [stream[i : i + 7] for i in range(0, len(stream), 7)]
    for i, p in enumerate(pieces):
        await call.write(body_msg(p, eos=i == len(pieces) - 1, response=True))
        (reply,) = await _read(call, 1)
        forwarded += reply.response_body.response.body_mutation.streamed_response.body
    assert forwarded == stream.replace(b'"adapter-1"', b'"split"')
    assert router.completed[-1][1:3] == (200, Usage(11, 3))
    call.cancel()


async def test_held_json_is_flushed_before_trailers(envoy: FakeEnvoy, router: FakeRouter) -> None:
    call, _ = await _streamed_request(envoy, b'{"model": "split"}', piece=100)
    await call.write(
        headers_msg({":status": "200", "content-type": "application/json"}, response=True)
    )
    await _read(call, 1)
    await call.write(body_msg(b'{"model": "adapter-1"}', eos=False, response=True))
    (held,) = await _read(call, 1)
    assert held.response_body.response.body_mutation.streamed_response.body == b""
    await call.write(pb.ProcessingRequest(response_trailers=pb.HttpTrailers()))
    flushed, trailers = await _read(call, 2)
    body = flushed.response_body.response.body_mutation.streamed_response.body
    assert body == b'{"model": "split"}'
    assert trailers.WhichOneof("response") == "response_trailers"
    call.cancel()


async def test_streamed_body_over_the_limit_is_413_without_routing(
    router: FakeRouter, ended: list[Exchange], transport: str
) -> None:
    settings = ExtProcSettings(max_request_body_bytes=64)
    at_limit = json.dumps({"model": "base", "pad": "x" * 36}).encode()
    assert len(at_limit) == 64
    async with _serving(router, ended, settings, transport) as envoy:
        call, replies = await _streamed_request(envoy, at_limit, piece=10)
        assert replies[0].WhichOneof("response") == "request_headers"  # exactly the limit: fine
        call.cancel()
        over = json.dumps({"model": "base", "pad": "x" * 37}).encode()
        call, replies = await _streamed_request(envoy, over, piece=10)
        (reply,) = replies
        assert reply.immediate_response.status.code == 413
        err = json.loads(reply.immediate_response.body)["error"]
        assert err["code"] == "request_too_large"
        await call.done_writing()
        await _until(lambda: len(ended) == 2)
    assert len(router.routed) == 1  # only the request at the limit reached the router
    assert [c[1] for c in router.completed] == [499]  # that one, cancelled; the 413 held nothing


@pytest.mark.parametrize(
    ("model", "logged"),
    [("boom", "routing failed"), ("nowhere", "rejected")],
)
async def test_router_failure_is_a_500_that_hides_the_details(
    envoy: FakeEnvoy,
    router: FakeRouter,
    ended: list[Exchange],
    caplog: pytest.LogCaptureFixture,
    model: str,
    logged: str,
) -> None:
    caplog.set_level(logging.INFO, logger="poolkeeper")
    call, replies = await _streamed_request(envoy, json.dumps({"model": model}).encode(), piece=4)
    (reply,) = replies
    imm = reply.immediate_response
    assert imm.status.code == 500
    err = json.loads(imm.body)["error"]
    assert err["type"] == "internal_error"
    assert "secret" not in imm.body.decode()
    assert logged in caplog.text
    await call.done_writing()
    await _until(lambda: ended)
    assert router.completed == []  # nothing was admitted, so nothing to release


async def test_request_body_ended_by_trailers(envoy: FakeEnvoy, router: FakeRouter) -> None:
    call = envoy.open()
    await call.write(headers_msg(post_headers(), mode=STREAMED))
    await call.write(body_msg(CHAT[:10], eos=False))
    await call.write(body_msg(CHAT[10:], eos=False))
    await call.write(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
    head, body, trailers = await _read(call, 3)
    assert _set_headers(head.request_headers.response.header_mutation)[DEST] == ",".join(PODS)
    streamed = body.request_body.response.body_mutation.streamed_response
    assert not streamed.end_of_stream  # the trailers end the stream, not the body
    assert json.loads(streamed.body)["model"] == "adapter-1"
    assert trailers.WhichOneof("response") == "request_trailers"
    assert router.routed[-1].body == CHAT
    call.cancel()


async def test_request_trailers_after_a_buffered_body_are_answered(
    envoy: FakeEnvoy, router: FakeRouter
) -> None:
    call = envoy.open()
    await call.write(headers_msg(post_headers(), mode=BUFFERED))
    await _read(call, 1)
    await call.write(body_msg(CHAT, eos=True))
    (routed,) = await _read(call, 1)
    assert _set_headers(routed.request_body.response.header_mutation)[DEST] == ",".join(PODS)
    await call.write(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
    (trailers,) = await _read(call, 1)
    assert trailers.WhichOneof("response") == "request_trailers"
    assert len(router.routed) == 1  # the trailers did not route the request again
    call.cancel()


@pytest.mark.parametrize(("status", "expected"), [("200", 1), ("503", 0)])
async def test_the_first_response_byte_of_a_success_is_reported_once(
    envoy: FakeEnvoy, router: FakeRouter, status: str, expected: int
) -> None:
    call, _ = await _streamed_request(envoy, b'{"model": "base"}', piece=100)
    await call.write(headers_msg({":status": status}, response=True))
    await _read(call, 1)
    assert router.first_bytes == []  # headers are not a byte of the body
    await call.write(body_msg(b"", eos=False, response=True))
    await call.write(body_msg(b"data: first\n\n", eos=False, response=True))
    await call.write(body_msg(b"data: second\n\n", eos=True, response=True))
    await _until(lambda: router.completed)
    assert len(router.first_bytes) == expected
    await call.done_writing()
