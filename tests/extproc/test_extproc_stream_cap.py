"""The EPP holds at most `max_streams` ext_proc streams (requestHandling.maxStreams), on both
transports: more get gRPC RESOURCE_EXHAUSTED at once, counted, and the room comes back as soon
as a held stream ends (issue 34: a direct or runaway client could open any number)."""

from __future__ import annotations

import asyncio

import grpc

from poolkeeper.extproc.contracts import ExtProcSettings
from poolkeeper.extproc.server import ExtProcServicer
from tests.extproc.extproc_fakes import (
    STREAMED,
    FakeEnvoy,
    FakeRouter,
    body_msg,
    headers_msg,
    post_headers,
    serving,
)


async def _until(predicate: object, what: str) -> None:
    for _ in range(500):
        if callable(predicate) and predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


async def test_streams_over_the_cap_get_resource_exhausted(transport: str) -> None:
    router = FakeRouter()
    servicer = ExtProcServicer(router, settings=ExtProcSettings(max_streams=2))
    async with serving(transport, servicer) as port:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        envoy = FakeEnvoy(channel)
        held = []
        for _ in range(2):  # headers sent, body still to come: the EPP holds the stream
            call = envoy.open()
            await call.write(headers_msg(post_headers(), mode=STREAMED))
            held.append(call)
        await _until(lambda: servicer.active == 2, "two streams held")

        over = envoy.open()  # refused on its HEADERS, before any message is read (a write
        # racing that answer fails in the gRPC client and changes the status it reports)
        assert await asyncio.wait_for(over.code(), 5) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "limit of 2 ext_proc streams" in await over.details()
        assert servicer.over_limit == 1
        assert servicer.active == 2  # the refused stream never counted
        assert router.routed == []  # and nothing of it reached the router

        held[0].cancel()  # one held stream ends: its room is free again at once
        await _until(lambda: servicer.active == 1, "the cancelled stream released")
        call = envoy.open()
        await call.write(headers_msg(post_headers(), mode=STREAMED))
        await call.write(body_msg(b'{"model": "base"}', eos=True))
        reply = await asyncio.wait_for(call.read(), 5)
        assert reply.WhichOneof("response") == "request_headers"  # routed
        assert servicer.over_limit == 1
        for c in (held[1], call):
            c.cancel()
        await _until(lambda: servicer.active == 0, "every stream released")
        await channel.close()
