"""The EPP's end of the response observer: access-log entries read into outcomes, detached
exchanges held and settled, and an ext_proc stream that ends once the request is routed.

Envoy's half (the Lua filter, the gRPC access log) runs against the real Envoy in
tests/envoy/test_envoy_observer.py; here a gRPC client plays Envoy (extproc_fakes.FakeEnvoy).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

import grpc
import pytest
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from google.protobuf import empty_pb2, struct_pb2, wrappers_pb2

from poolkeeper import observation as wire
from poolkeeper.extproc.accesslog import DetachedExchanges
from poolkeeper.extproc.contracts import CANCELLED_STATUS, ExtProcSettings
from poolkeeper.extproc.outcome import CUT_STATUS, UNKNOWN_STATUS, Outcome, outcome_of
from poolkeeper.extproc.server import ExtProcServicer
from poolkeeper.extproc.state import Exchange
from tests.extproc.extproc_fakes import (
    STREAMED,
    FakeEnvoy,
    FakeRouter,
    body_msg,
    headers_msg,
    post_headers,
    serving,
)


def _entry(
    key: object = "k-1",
    *,
    status: int = 200,
    fields: Mapping[str, object] | None = None,
    flags: tuple[str, ...] = (),
    sent_at_ms: int | None = None,
) -> accesslog_pb2.HTTPAccessLogEntry:
    """An entry as Envoy logs it; `sent_at_ms`: the request went upstream then (Envoy's
    timing: the stream's start, 7 ms before, plus its time to the first upstream byte)."""
    entry = accesslog_pb2.HTTPAccessLogEntry()
    entry.response.response_code.value = status
    entry.response.response_body_bytes = 321
    common = entry.common_properties
    meta = struct_pb2.Struct()
    values: dict[str, Any] = {**({wire.EXCHANGE: key} if key is not None else {}), **(fields or {})}
    meta.update(values)
    common.metadata.filter_metadata[wire.NAMESPACE].CopyFrom(meta)
    common.upstream_remote_address.socket_address.address = "10.0.0.2"
    common.upstream_remote_address.socket_address.port_value = 8000
    common.time_to_last_downstream_tx_byte.FromMilliseconds(250)
    if sent_at_ms is not None:
        common.start_time.FromMilliseconds(sent_at_ms - 7)
        common.time_to_first_upstream_tx_byte.FromMilliseconds(7)
    for flag in flags:
        setattr(common.response_flags, flag, True)
    return entry


def test_an_entry_becomes_its_outcome() -> None:
    fields = {
        wire.FIRST_BYTE_AT: 1_040.0,
        wire.PROMPT_TOKENS: 12,
        wire.COMPLETION_TOKENS: 30,
        wire.CACHED_TOKENS: 8,
        wire.EVENTS: 32,
        wire.DONE_EVENTS: 1,
    }
    parsed = outcome_of(_entry(fields=fields, sent_at_ms=1_000))
    assert parsed is not None
    key, outcome = parsed
    assert key == "k-1"
    assert outcome == Outcome(
        status=200,
        served="10.0.0.2:8000",
        first_byte_after_s=0.04,  # (1040 - 1000) ms: the first byte after the request went
        prompt_tokens=12,
        completion_tokens=30,
        cached_tokens=8,
        events=32,
        done_events=1,
        response_bytes=321,
        duration_s=0.25,
    )


def test_the_first_byte_is_timed_from_envoys_first_upstream_byte() -> None:
    """No Lua stamp on the request path: the request left when Envoy sent its first byte
    upstream; an entry without that timing (nothing was sent) has no first-byte time."""
    fields = {wire.FIRST_BYTE_AT: 2_000.0}
    parsed = outcome_of(_entry(fields=fields, sent_at_ms=1_990))
    assert parsed is not None
    assert parsed[1].first_byte_after_s == pytest.approx(0.010)
    # Sent 0.7 ms into a millisecond whose stamp the first byte shares: 0 s, not -0.7 ms.
    entry = _entry(fields=fields)
    entry.common_properties.start_time.FromNanoseconds(1_999_000_000)
    entry.common_properties.time_to_first_upstream_tx_byte.FromNanoseconds(1_700_000)
    parsed = outcome_of(entry)
    assert parsed is not None
    assert parsed[1].first_byte_after_s == 0.0
    parsed = outcome_of(_entry(fields=fields))
    assert parsed is not None
    assert parsed[1].first_byte_after_s is None
    # A clock that went backwards (a first byte before the request left) is no time at all.
    parsed = outcome_of(_entry(fields=fields, sent_at_ms=2_100))
    assert parsed is not None
    assert parsed[1].first_byte_after_s is None


@pytest.mark.parametrize(
    "flags",
    [
        ("downstream_remote_reset",),
        ("upstream_remote_reset",),
        ("local_reset",),
        ("upstream_protocol_error",),  # unfinished chunked encoding: a backend that died
        ("stream_idle_timeout",),
    ],
)
def test_a_response_cut_short_is_reported_as_cut(flags: tuple[str, ...]) -> None:
    parsed = outcome_of(_entry(flags=flags))
    assert parsed is not None
    assert parsed[1].status == CUT_STATUS
    # Before any response began, the failure has its own status (Envoy's local reply).
    parsed = outcome_of(_entry(status=504, flags=flags))
    assert parsed is not None
    assert parsed[1].status == 504


def test_a_client_that_closes_just_after_the_whole_response_got_it() -> None:
    """The Lua filter's counts are written once the whole body passed: then a closed client
    connection did not cut the response; a model server's broken response stays cut."""
    whole = {wire.EVENTS: 0, wire.DONE_EVENTS: 0}
    closed = outcome_of(_entry(fields=whole, flags=("downstream_connection_termination",)))
    assert closed is not None
    assert closed[1].status == 200
    broken = outcome_of(_entry(fields=whole, flags=("upstream_protocol_error",)))
    assert broken is not None
    assert broken[1].status == CUT_STATUS


def test_no_status_at_all_is_cut_and_missing_fields_stay_unknown() -> None:
    parsed = outcome_of(_entry(status=0))
    assert parsed is not None
    outcome = parsed[1]
    assert outcome.status == CUT_STATUS
    assert (outcome.first_byte_after_s, outcome.prompt_tokens, outcome.events) == (None, None, 0)


@pytest.mark.parametrize("key", [None, 7, True])
def test_entries_without_a_string_key_are_not_ours(key: object) -> None:
    assert outcome_of(_entry(key)) is None
    assert outcome_of(accesslog_pb2.HTTPAccessLogEntry()) is None


@pytest.mark.parametrize("bad", [-1, 2.0**60, "12", True])
def test_token_counts_that_are_not_counts_are_dropped(bad: object) -> None:
    parsed = outcome_of(_entry(fields={wire.COMPLETION_TOKENS: bad}))
    assert parsed is not None
    assert parsed[1].completion_tokens is None


class _Waiting:
    def __init__(self) -> None:
        self.outcomes: list[Outcome] = []
        self.first_bytes = 0

    def observed(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)

    def first_byte_passed(self) -> None:
        self.first_bytes += 1


def test_a_first_byte_report_reaches_only_its_own_waiting_exchange() -> None:
    room = DetachedExchanges()
    a, b = _Waiting(), _Waiting()
    key_a, _ = room.hold(a), room.hold(b)
    assert room.first_byte(key_a)
    assert not room.first_byte("someone-else")
    assert (a.first_bytes, b.first_bytes) == (1, 0)
    assert len(room) == 2  # still waiting for the access-log entry
    assert room.settle(key_a, Outcome(status=200))
    assert not room.first_byte(key_a)  # settled: a late report finds nothing


def test_detached_exchanges_are_settled_once_by_their_own_key() -> None:
    room = DetachedExchanges()
    a, b = _Waiting(), _Waiting()
    key_a, key_b = room.hold(a), room.hold(b)
    assert key_a != key_b
    assert len(room) == 2
    assert room.settle(key_b, Outcome(status=200))
    assert not room.settle(key_b, Outcome(status=500))  # a duplicate entry changes nothing
    assert not room.settle("someone-else", Outcome(status=200))
    assert (a.outcomes, b.outcomes) == ([], [Outcome(status=200)])
    room.discard(key_a)
    assert len(room) == 0
    assert a.outcomes == []
    # A later process never takes an earlier one's keys for its own.
    assert DetachedExchanges().hold(_Waiting()) != DetachedExchanges().hold(_Waiting())


def test_the_waiting_room_is_bounded_by_count_and_by_age() -> None:
    now = [0.0]
    room = DetachedExchanges(limit=2, ttl_s=10.0, clock=lambda: now[0])
    first, second, third = _Waiting(), _Waiting(), _Waiting()
    room.hold(first)
    now[0] = 5.0
    room.hold(second)
    room.hold(third)  # over the limit: the oldest is given up on
    assert first.outcomes == [Outcome(status=UNKNOWN_STATUS)]
    assert len(room) == 2
    now[0] = 12.0
    assert room.expire() == 0  # both still younger than the TTL
    now[0] = 15.5
    assert room.expire() == 2
    assert second.outcomes == third.outcomes == [Outcome(status=UNKNOWN_STATUS)]
    assert (len(room), room.expired) == (0, 3)


@contextlib.asynccontextmanager
async def _serving(
    router: FakeRouter, room: DetachedExchanges, transport: str
) -> AsyncIterator[tuple[FakeEnvoy, grpc.aio.Channel]]:
    servicer = ExtProcServicer(router, settings=ExtProcSettings(), detached=room)
    async with serving(transport, servicer, detached=room) as port:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        try:
            yield FakeEnvoy(channel), channel
        finally:
            await channel.close()


async def _route(envoy: FakeEnvoy, body: dict[str, object]) -> tuple[list[object], object]:
    """Headers and the whole body, then the routing replies; then response headers, which
    only an EPP still on the stream answers. Returns (routing replies, the stream's status
    code if the EPP ended it, else None)."""
    call = envoy.open()
    await call.write(headers_msg(post_headers(), mode=STREAMED))
    await call.write(body_msg(json.dumps(body).encode(), eos=True))
    replies = [await asyncio.wait_for(call.read(), 5) for _ in range(2)]
    after = await asyncio.wait_for(call.read(), 5)
    if after is grpc.aio.EOF:
        return replies, await call.code()
    raise AssertionError(f"an unexpected reply: {after}")


async def test_a_routed_request_leaves_the_stream_and_its_log_entry_completes_it(
    transport: str,
) -> None:
    router, room = FakeRouter(), DetachedExchanges()
    async with _serving(router, room, transport) as (envoy, channel):
        replies, code = await _route(envoy, {"model": "base", "prompt": "hi"})
        assert code == grpc.StatusCode.OK  # the EPP ended its stream after routing
        kinds = [r.WhichOneof("response") for r in replies]  # type: ignore[attr-defined]
        assert kinds == ["request_headers", "request_body"]
        key = _metadata(replies).get(wire.EXCHANGE)
        assert key is not None
        assert wire.RESPONSE_PATH not in _metadata(replies)  # no rewrite: never comes back
        assert len(room) == 1
        assert router.completed == []  # the response has not ended yet: still in flight

        # Envoy's access log: one message carrying this request's entry and a stranger's.
        stub = als_pb2_grpc.AccessLogServiceStub(channel)
        fields = {wire.FIRST_BYTE_AT: 35.0, wire.COMPLETION_TOKENS: 9}
        message = als_pb2.StreamAccessLogsMessage()
        entry = _entry(key, fields=fields, sent_at_ms=10)
        message.http_logs.log_entry.extend([entry, _entry("other")])

        async def entries() -> AsyncIterator[als_pb2.StreamAccessLogsMessage]:
            yield message

        await asyncio.wait_for(stub.StreamAccessLogs(entries()), 5)
    ((decision, status, usage, served),) = router.completed
    assert (decision.model_name, status, served) == ("base", 200, "10.0.0.2:8000")
    assert usage is not None
    assert (usage.completion_tokens, usage.estimated) == (9, False)
    assert router.first_bytes == ["req-1"]  # told once, with Envoy's timing
    assert router.first_byte_after == [pytest.approx(0.025)]
    assert len(room) == 0


async def test_a_first_byte_report_tells_the_router_before_the_log_entry_and_only_once(
    transport: str,
) -> None:
    router, room = FakeRouter(), DetachedExchanges()
    async with _serving(router, room, transport) as (envoy, channel):
        replies, _ = await _route(envoy, {"model": "base", "prompt": "hi", "stream": True})
        key = _metadata(replies)[wire.EXCHANGE]
        # What the Lua filter sends: a unary call with the key as a StringValue.
        report = channel.unary_unary(
            wire.FIRST_BYTE_PATH,
            request_serializer=wrappers_pb2.StringValue.SerializeToString,
            response_deserializer=empty_pb2.Empty.FromString,
        )
        answer = await asyncio.wait_for(report(wrappers_pb2.StringValue(value=key)), 5)
        assert answer == empty_pb2.Empty()
        assert router.first_bytes == ["req-1"]
        assert router.first_byte_after == [None]  # now, on the EPP's clock
        assert router.completed == []  # still in flight
        # A stranger's key and a repeated report are answered and change nothing.
        await asyncio.wait_for(report(wrappers_pb2.StringValue(value="other")), 5)
        await asyncio.wait_for(report(wrappers_pb2.StringValue(value=key)), 5)
        assert router.first_bytes == ["req-1"]
        stub = als_pb2_grpc.AccessLogServiceStub(channel)
        fields = {wire.FIRST_BYTE_AT: 35.0}
        message = als_pb2.StreamAccessLogsMessage()
        message.http_logs.log_entry.extend([_entry(key, fields=fields, sent_at_ms=10)])

        async def entries() -> AsyncIterator[als_pb2.StreamAccessLogsMessage]:
            yield message

        await asyncio.wait_for(stub.StreamAccessLogs(entries()), 5)
    assert len(router.completed) == 1
    assert router.first_bytes == ["req-1"]  # the entry's first-byte time is not told again


def _metadata(replies: list[object]) -> dict[str, str]:
    for reply in replies:
        meta = reply.dynamic_metadata.fields.get(wire.NAMESPACE)  # type: ignore[attr-defined]
        if meta is not None:
            return {k: v.string_value for k, v in meta.struct_value.fields.items()}
    return {}


async def _response_stream(envoy: FakeEnvoy, key: str | None, sse: bytes) -> bytes:
    """The response processor's stream: response headers (with the forwarded exchange key)
    and one SSE body; returns the body the EPP sends back."""
    call = envoy.open()
    first = headers_msg({":status": "200", "content-type": "text/event-stream"}, response=True)
    first.protocol_config.response_body_mode = STREAMED
    if key is not None:
        meta = struct_pb2.Struct()
        meta.update({wire.EXCHANGE: key})
        first.metadata_context.filter_metadata[wire.NAMESPACE].CopyFrom(meta)
    await call.write(first)
    await call.write(body_msg(sse, eos=True, response=True))
    headers_reply = await asyncio.wait_for(call.read(), 5)
    assert headers_reply.WhichOneof("response") == "response_headers"
    out: bytes = b""
    while True:
        reply = await asyncio.wait_for(call.read(), 5)
        streamed = reply.response_body.response.body_mutation.streamed_response
        out += streamed.body
        if streamed.end_of_stream:
            break
    await call.done_writing()
    return out


SSE = (
    b'data: {"model": "adapter-1", "choices": [{"delta": {"content": "hi"}}]}\n\n'
    b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}\n\n'
    b"data: [DONE]\n\n"
)


async def test_a_response_the_epp_rewrites_comes_back_on_the_response_processors_stream(
    transport: str,
) -> None:
    router, room = FakeRouter(), DetachedExchanges()
    async with _serving(router, room, transport) as (envoy, _):
        # `split` is served as adapter-1 and the EPP injected include_usage: the client must
        # get its own model name back and no usage chunk, so the response comes to the EPP.
        replies, code = await _route(envoy, {"model": "split", "prompt": "hi", "stream": True})
        assert code == grpc.StatusCode.OK
        names = _metadata(replies)
        assert names[wire.RESPONSE_PATH] == wire.VIA_EPP
        assert len(room) == 1
        out = await _response_stream(envoy, names[wire.EXCHANGE], SSE)
        await _until_completed(router)
    assert b'"model": "split"' in out
    assert b"usage" not in out  # the injected usage chunk was removed
    assert out.endswith(b"data: [DONE]\n\n")
    ((decision, status, usage, _),) = router.completed
    assert (decision.model_name, status) == ("split", 200)
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens, usage.estimated) == (3, 1, False)
    assert len(room) == 0  # taken over by the response stream: no access-log entry awaited


async def test_a_response_stream_for_an_unknown_key_passes_the_response_on(transport: str) -> None:
    router, room = FakeRouter(), DetachedExchanges()
    async with _serving(router, room, transport) as (envoy, _):
        assert await _response_stream(envoy, "an-earlier-process-1", SSE) == SSE
        assert await _response_stream(envoy, None, SSE) == SSE
    assert router.completed == []


async def _until_completed(router: FakeRouter) -> None:
    for _ in range(500):
        if router.completed:
            return
        await asyncio.sleep(0.01)


async def test_a_stream_without_usage_is_estimated_one_token_per_event() -> None:
    router = FakeRouter()
    exchange = Exchange(router, detached=DetachedExchanges())
    # The client asked for usage itself: nothing injected, so nothing for the EPP to strip.
    body = {
        "model": "base",
        "prompt": "x",
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    await exchange.handle(headers_msg(post_headers(), mode=STREAMED))
    await exchange.handle(body_msg(json.dumps(body).encode(), eos=True))
    assert exchange.detach_key is not None
    # Its stream ended once routed; the access log (here: called directly) tells the end.
    exchange.observed(Outcome(status=200, events=6, done_events=1, first_byte_after_s=0.02))
    ((_, status, usage, _),) = router.completed
    assert status == 200
    assert usage is not None
    assert (usage.completion_tokens, usage.estimated) == (5, True)
    assert router.first_bytes == [exchange.request_id]
    exchange.observed(Outcome(status=500))  # a second report changes nothing
    assert len(router.completed) == 1


async def test_a_stream_broken_before_the_handoff_is_cancelled_and_forgotten() -> None:
    router, room = FakeRouter(), DetachedExchanges()
    exchange = Exchange(router, detached=room)
    await exchange.handle(headers_msg(post_headers(), mode=STREAMED))
    await exchange.handle(body_msg(b'{"model": "base"}', eos=True))
    assert len(room) == 1
    exchange.close()  # the replies may never have reached Envoy: nothing will be logged
    assert len(room) == 0
    assert [status for _, status, _, _ in router.completed] == [CANCELLED_STATUS]


def test_timestamps_and_durations_read_as_protobuf_converts_them() -> None:
    """`_sent_at_ms` and `duration_s` without protobuf's converters give their exact values,
    and an invalid Timestamp still raises as `ToNanoseconds` does."""
    import random

    from google.protobuf import duration_pb2, timestamp_pb2

    from poolkeeper.extproc.outcome import _duration_s, _sent_at_ms

    rng = random.Random(3)
    cases = [(0, 0), (0, 999_999_999), (1, 1), (315_576_000_000, 999_999_999), (-1, -5)]
    cases += [(rng.randrange(10**9), rng.randrange(10**9)) for _ in range(300)]
    for seconds, nanos in cases:
        d = duration_pb2.Duration(seconds=seconds, nanos=nanos)
        assert _duration_s(d) == d.ToTimedelta().total_seconds(), (seconds, nanos)
    entry = accesslog_pb2.HTTPAccessLogEntry()
    common = entry.common_properties
    for _ in range(300):
        common.start_time.seconds = rng.randrange(-62_135_596_800, 253_402_300_800)
        common.start_time.nanos = rng.randrange(10**9)
        common.time_to_first_upstream_tx_byte.seconds = rng.randrange(10**6)
        common.time_to_first_upstream_tx_byte.nanos = rng.randrange(10**9)
        sent = common.start_time.ToNanoseconds()
        sent += common.time_to_first_upstream_tx_byte.ToNanoseconds()
        assert _sent_at_ms(common) == float(sent // 1_000_000)
    common.start_time.CopyFrom(timestamp_pb2.Timestamp(seconds=253_402_300_800))
    with pytest.raises(ValueError, match="Timestamp is not valid"):
        _sent_at_ms(common)


def test_an_entry_without_flags_is_not_cut_and_one_with_any_is_read() -> None:
    whole = outcome_of(_entry(fields={wire.EVENTS: 3}))
    assert whole is not None
    assert whole[1].status == 200
    for flag in ("upstream_remote_reset", "local_reset"):
        cut = outcome_of(_entry(flags=(flag,)))  # no events counted: the response had not ended
        assert cut is not None
        assert cut[1].status == 499, flag
    other = outcome_of(_entry(flags=("no_healthy_upstream",)))  # a flag that is not a cut
    assert other is not None
    assert other[1].status == 200
