"""The lean transport (extproc/h2/) on real loopback sockets: gRPC over HTTP/2 as Envoy and
grpcio speak it, and every limit of `Limits` holding against a peer that breaks the rules."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import hpack
import pytest
from prometheus_client import CollectorRegistry

from poolkeeper.extproc.h2 import frames as f, shared as h2_shared
from poolkeeper.extproc.h2.headers import HeaderDecoder, table_neutral
from poolkeeper.extproc.h2.limits import Limits
from poolkeeper.extproc.h2.rpc import (
    RESOURCE_EXHAUSTED,
    UNIMPLEMENTED,
    MessageReader,
    RpcError,
    envelope,
)
from poolkeeper.extproc.h2.server import tls_context
from poolkeeper.server.transport import export_transport
from tests.extproc.h2_peer import PATH, Peer, echo_method, goaway_code, lean

pytestmark = pytest.mark.integration


async def _until(condition: Callable[[], bool]) -> None:
    """Polls `condition` every 5 ms; the bound (10 s) only ends a failing test."""
    for _ in range(2000):
        if condition():
            return
        await asyncio.sleep(0.005)


async def test_a_stream_is_echoed_with_grpc_status_0() -> None:
    async with lean() as server:
        peer = await Peer.connect(server.port)
        sid = peer.open()
        peer.message(sid, b"one")
        peer.message(sid, b"two", end_stream=True)
        messages, trailers = await peer.response(sid)
        assert messages == [b"one", b"two"]
        assert trailers["grpc-status"] == "0"
        await peer.close()


async def test_envoys_reset_after_trailers_never_counts_as_an_attack() -> None:
    """Envoy resets every ext_proc stream once the processor's trailers arrive."""
    limits = Limits(reset_burst=5, reset_per_s=0.0, control_burst=20, control_per_s=0.0)
    async with lean(limits=limits) as server:
        peer = await Peer.connect(server.port)
        for _ in range(300):
            sid = peer.open()
            peer.message(sid, b"x", end_stream=True)
            _, trailers = await peer.response(sid)
            assert trailers["grpc-status"] == "0"
            peer.send(f.rst_stream(sid, f.INTERNAL_ERROR))
        sid = peer.open()
        peer.message(sid, b"still here", end_stream=True)
        assert (await peer.response(sid))[0] == [b"still here"]
        assert server.stats.premature_resets == 0
        assert server.stats.goaways == {}
        await peer.close()


async def _forever(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for _ in requests:
        await asyncio.Event().wait()
    yield b""  # pragma: no cover


async def test_rapid_reset_closes_the_connection() -> None:
    limits = Limits(reset_burst=50, reset_per_s=0.0)
    async with lean({PATH: echo_method(_forever)}, limits=limits) as server:
        peer = await Peer.connect(server.port)
        for _ in range(60):
            sid = peer.open()
            peer.message(sid, b"x")
            await asyncio.sleep(0)
            peer.send(f.rst_stream(sid, f.CANCEL))
        assert goaway_code(await peer.until(f.GOAWAY)) == f.ENHANCE_YOUR_CALM
        assert server.stats.premature_resets >= 50
        await peer.close()


@pytest.mark.parametrize(
    "flood",
    [
        f.frame(f.PING, 0, 0, b"12345678"),
        f.settings({f.ENABLE_PUSH: 0}),
        f.frame(f.PRIORITY, 0, 1, b"\x00\x00\x00\x00\x10"),
        f.frame(0x42, 0, 0, b"unknown"),
    ],
    ids=["ping", "settings", "priority", "unknown"],
)
async def test_control_frame_floods_close_the_connection(flood: bytes) -> None:
    limits = Limits(control_burst=100, control_per_s=0.0)
    async with lean(limits=limits) as server:
        peer = await Peer.connect(server.port)
        peer.send(flood * 150)
        assert goaway_code(await peer.until(f.GOAWAY)) == f.ENHANCE_YOUR_CALM
        assert server.stats.goaways == {"enhance_your_calm": 1}
        await peer.close()


async def test_the_counters_are_exported_as_prometheus_metrics() -> None:
    """What `serve` exports for the lean transport (server/transport.py): streams, refused
    ones, and GOAWAYs by reason, read from the server's counters at scrape time."""
    limits = Limits(control_burst=100, control_per_s=0.0)
    async with lean(limits=limits) as server:
        registry = CollectorRegistry()
        export_transport(registry, server)
        peer = await Peer.connect(server.port)
        sid = peer.open()
        peer.message(sid, b"x", end_stream=True)
        assert (await peer.response(sid))[1]["grpc-status"] == "0"
        peer.send(f.frame(f.PING, 0, 0, b"12345678") * 150)
        assert goaway_code(await peer.until(f.GOAWAY)) == f.ENHANCE_YOUR_CALM
        await peer.close()
        value = registry.get_sample_value
        assert value("poolkeeper_extproc_transport_streams_total") == 1
        assert value("poolkeeper_extproc_transport_connections_total") == 1
        labels = {"reason": "enhance_your_calm"}
        assert value("poolkeeper_extproc_transport_goaways_total", labels) == 1
        assert value("poolkeeper_extproc_transport_handler_errors_total") == 0


async def test_pings_within_the_allowance_are_answered() -> None:
    async with lean() as server:
        peer = await Peer.connect(server.port)
        peer.send(f.frame(f.PING, 0, 0, b"abcdefgh"))
        frame = await peer.until(f.PING)
        assert frame is not None
        assert frame.flags & f.ACK
        assert frame.payload == b"abcdefgh"
        await peer.close()


async def test_continuation_flood_closes_the_connection() -> None:
    async with lean(limits=Limits(max_continuation_frames=4)) as server:
        peer = await Peer.connect(server.port)
        block = peer.headers_block()
        peer.send(f.frame(f.HEADERS, 0, 1, block[:4]))
        for _ in range(6):
            peer.send(f.frame(f.CONTINUATION, 0, 1, b""))
        assert goaway_code(await peer.until(f.GOAWAY)) == f.ENHANCE_YOUR_CALM
        await peer.close()


async def test_a_header_block_over_the_limit_closes_the_connection() -> None:
    async with lean(limits=Limits(max_header_block_bytes=1024)) as server:
        peer = await Peer.connect(server.port)
        block = peer.headers_block()
        peer.send(f.frame(f.HEADERS, 0, 1, block))
        for _ in range(3):
            peer.send(f.frame(f.CONTINUATION, 0, 1, b"\x00" * 500))
        assert goaway_code(await peer.until(f.GOAWAY)) == f.ENHANCE_YOUR_CALM
        await peer.close()


async def test_a_malformed_header_block_is_a_compression_error() -> None:
    async with lean() as server:
        peer = await Peer.connect(server.port)
        peer.send(f.frame(f.HEADERS, f.END_HEADERS, 1, b"\xff\xff\xff\xff\xff"))
        assert goaway_code(await peer.until(f.GOAWAY)) == f.COMPRESSION_ERROR
        await peer.close()


async def test_streams_over_the_limit_are_refused() -> None:
    async with lean({PATH: echo_method(_forever)}, limits=Limits(max_concurrent_streams=2)) as s:
        peer = await Peer.connect(s.port)
        for _ in range(3):
            peer.open()
        frame = await peer.until(f.RST_STREAM)
        assert frame is not None
        assert frame.stream_id == 5
        assert f.u32(frame.payload) == f.REFUSED_STREAM
        assert s.stats.refused_streams == 1
        await peer.close()


async def test_replies_wait_for_the_peers_window() -> None:
    async with lean() as server:
        peer = await Peer.connect(server.port, settings={f.INITIAL_WINDOW_SIZE: 100})
        sid = peer.open()
        peer.message(sid, b"y" * 1000, end_stream=True)
        sent = 0
        while sent < 100:
            frame = await peer.read_frame()
            assert frame is not None
            assert frame.kind != f.GOAWAY
            if frame.kind == f.DATA:
                sent += len(frame.payload)
            assert frame.kind != f.HEADERS or not frame.flags & f.END_STREAM
        assert sent == 100  # exactly the window, and no trailers before the rest
        peer.send(f.window_update(sid, 10_000))
        _messages, trailers = await peer.response(sid)
        assert trailers["grpc-status"] == "0"
        await peer.close()


async def test_a_handler_that_does_not_read_holds_the_peer_to_its_window() -> None:
    """Credit for queued messages waits for the handler; data beyond the window resets the
    stream (FLOW_CONTROL_ERROR) and leaves the connection up."""
    limits = Limits(stream_window=65_535, connection_window=65_535)
    async with lean({PATH: echo_method(_forever)}, limits=limits) as server:
        peer = await Peer.connect(server.port)
        sid = peer.open()
        for _ in range(10):
            peer.message(sid, b"z" * 15_000)  # the handler reads the first and no more
        frame = await peer.until(f.RST_STREAM, sid)
        assert frame is not None
        assert f.u32(frame.payload) == f.FLOW_CONTROL_ERROR
        other = peer.open()
        peer.send(f.frame(f.PING, 0, 0, b"stillup!"))
        assert (await peer.until(f.PING)) is not None
        assert other == sid + 2
        await peer.close()


async def test_a_big_message_arrives_whole_across_window_updates() -> None:
    async with lean() as server:
        peer = await Peer.connect(server.port)
        sid = peer.open()
        body = bytes(range(256)) * 40_000  # 10 MB: more than the stream's window
        data = b"\x00" + len(body).to_bytes(4, "big") + body
        for at in range(0, len(data), 16_384):
            flags = f.END_STREAM if at + 16_384 >= len(data) else 0
            peer.send(f.frame(f.DATA, flags, sid, data[at : at + 16_384]))
            await peer.writer.drain()
        messages, _trailers = await peer.response(sid)
        assert messages == [body]
        await peer.close()


async def test_a_handler_error_is_grpc_status_internal_and_rpc_error_its_own_code() -> None:
    async def broken(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async for message in requests:
            if message == b"rpc":
                raise RpcError(9, "precondition")
            raise ValueError("boom")
        yield b""  # pragma: no cover

    async with lean({PATH: echo_method(broken)}) as server:
        peer = await Peer.connect(server.port)
        first, second = peer.open(), peer.open()
        peer.message(first, b"boom")
        peer.message(second, b"rpc")
        assert (await peer.response(first))[1]["grpc-status"] == "13"
        assert (await peer.response(second))[1] == {
            ":status": "200", "content-type": "application/grpc", "grpc-status": "9",
            "grpc-message": "precondition",
        }  # fmt: skip
        assert server.stats.handler_errors == 1
        await peer.close()


async def test_unknown_methods_are_unimplemented() -> None:
    async with lean() as server:
        peer = await Peer.connect(server.port)
        sid = peer.open("/no.Such/Method", end_stream=True)
        assert (await peer.response(sid))[1]["grpc-status"] == "12"
        await peer.close()


async def test_without_the_token_calls_are_refused_and_then_the_connection() -> None:
    async with lean(token="secret", limits=Limits(max_unauthenticated=3)) as server:
        peer = await Peer.connect(server.port)
        sid = peer.open(token="secret")
        peer.message(sid, b"ok", end_stream=True)
        assert (await peer.response(sid))[0] == [b"ok"]
        for token in (None, "wrong", "secre"):
            sid = peer.open(token=token, end_stream=True)
            assert (await peer.response(sid))[1]["grpc-status"] == "16"
        peer.open(end_stream=True)
        assert goaway_code(await peer.until(f.GOAWAY)) == f.ENHANCE_YOUR_CALM
        assert server.stats.unauthenticated == 4
        await peer.close()


async def _closed_on_accept(port: int) -> bool:
    """Whether a fresh connection is closed before the server's SETTINGS arrive."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f.PREFACE + f.settings({}))
    try:
        first = await asyncio.wait_for(reader.read(9), 10)
    except ConnectionResetError:
        first = b""
    writer.close()
    return first == b""


async def test_connections_over_the_limit_are_closed_counted_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """More than `max_connections` at once: the new one is closed on accept, counted
    (`refused_connections`, exported) and warned about once per interval, not per connection."""
    async with lean(limits=Limits(max_connections=2)) as server:
        first, second = await Peer.connect(server.port), await Peer.connect(server.port)
        with caplog.at_level("WARNING", logger="poolkeeper.extproc.h2"):
            assert await _closed_on_accept(server.port)
            assert await _closed_on_accept(server.port)
        assert server.stats.refused_connections == 2
        warnings = [r.getMessage() for r in caplog.records if "on accept" in r.getMessage()]
        assert warnings == ["closed 1 ext_proc connection(s) on accept: 2 were open (the limit)"]
        sid = second.open()  # the open ones are unaffected
        second.message(sid, b"still", end_stream=True)
        assert (await second.response(sid))[0] == [b"still"]
        await first.close()
        await _until(lambda: server.stats.open_connections == 1)
        assert not await _closed_on_accept(server.port)  # a place freed
        registry = CollectorRegistry()
        export_transport(registry, server)
        value = registry.get_sample_value("poolkeeper_extproc_transport_refused_connections_total")
        assert value == 2
        await second.close()
        # The second refusal, inside the interval, is told when the server stops at the latest.
    warnings = [r.getMessage() for r in caplog.records if "on accept" in r.getMessage()]
    assert warnings[1:] == ["closed 1 ext_proc connection(s) on accept: 2 were open (the limit)"]


async def test_refusals_after_a_warning_are_told_when_the_interval_is_over(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A burst of refusals: the first is told at once, the rest of the burst once, when the
    interval is over, without waiting for a refusal after it."""
    monkeypatch.setattr(h2_shared, "REFUSAL_LOG_EVERY_S", 1.0)
    async with lean(limits=Limits(max_connections=1)) as server:
        held = await Peer.connect(server.port)
        with caplog.at_level("WARNING", logger="poolkeeper.extproc.h2"):
            for _ in range(3):
                assert await _closed_on_accept(server.port)

            def told() -> list[int]:  # the count in each warning so far
                return [
                    int(r.getMessage().split()[1])
                    for r in caplog.records
                    if "on accept" in r.getMessage()
                ]

            # All three told while the server still runs and nothing else is refused (on a
            # quick machine "1" then "2"; a slow burst may span two intervals).
            await _until(lambda: sum(told()) == 3)
        assert told()[0] == 1  # the first at once
        assert len(told()) < 3 or told() == [1, 1, 1]
        assert server.stats.refused_connections == 3
        await held.close()


async def test_a_bad_preface_closes_the_connection() -> None:
    async with lean() as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"GET" not in await asyncio.wait_for(reader.read(), 10)
        writer.close()


async def test_drain_finishes_open_streams_and_refuses_new_ones() -> None:
    release = asyncio.Event()

    async def slow(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async for message in requests:
            await release.wait()
            yield message

    async with lean({PATH: echo_method(slow)}) as server:
        peer = await Peer.connect(server.port)
        sid = peer.open()
        peer.message(sid, b"in flight", end_stream=True)
        await _until(lambda: server.active_streams == 1)
        stopping = asyncio.create_task(server.stop(30))
        frame = await peer.until(f.GOAWAY)
        assert goaway_code(frame) == f.NO_ERROR
        assert frame is not None
        assert f.u32(frame.payload[:4]) == sid
        late = peer.open(end_stream=True)
        assert f.u32((await peer.until(f.RST_STREAM, late)).payload) == f.REFUSED_STREAM  # type: ignore[union-attr]
        release.set()
        assert (await peer.response(sid))[0] == [b"in flight"]
        await asyncio.wait_for(stopping, 10)
        assert await peer.read_frame() is None  # closed once idle
        await peer.close()


async def test_grpcio_clients_interoperate() -> None:
    async with lean() as server, grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        call = channel.stream_stream(PATH)
        replies = [r async for r in call(iter([b"a", b"bb", b"c" * 100_000]))]
        assert replies == [b"a", b"bb", b"c" * 100_000]
        unknown = channel.unary_unary("/x.Y/Z")
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await unknown(b"")
        assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED


def _self_signed(directory: Path) -> tuple[Path, Path]:
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
async def test_tls_with_alpn_h2_serves_grpcio_and_refuses_other_protocols(tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    async with lean(tls=tls_context(str(cert), str(key))) as server:
        credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        async with grpc.aio.secure_channel(f"localhost:{server.port}", credentials) as channel:
            replies = [r async for r in channel.stream_stream(PATH)(iter([b"over", b"tls"]))]
            assert replies == [b"over", b"tls"]
        client = ssl.create_default_context(cafile=str(cert))
        client.set_alpn_protocols(["http/1.1"])
        reader, writer = await asyncio.open_connection(
            "localhost", server.port, ssl=client, server_hostname="localhost"
        )
        writer.write(f.PREFACE)
        with contextlib.suppress(ConnectionResetError, ssl.SSLError):
            assert await asyncio.wait_for(reader.read(), 10) == b""  # closed, nothing served
        writer.close()


def test_the_transport_serves_on_uvloop_as_serve_runs_it() -> None:
    uvloop = pytest.importorskip("uvloop")

    async def exchange() -> list[bytes]:
        async with lean() as server:
            peer = await Peer.connect(server.port)
            sid = peer.open()
            peer.message(sid, b"uv", end_stream=True)
            messages, _ = await peer.response(sid)
            await peer.close()
            return messages

    assert uvloop.run(exchange()) == [b"uv"]


def test_table_neutral_header_blocks_are_remembered_and_indexing_literals_forget_them() -> None:
    encoder = hpack.Encoder()
    decoder, reference = HeaderDecoder(16_384), hpack.Decoder()
    request = [(":method", "POST"), (":path", PATH), ("x-token", "secret")]
    first = encoder.encode(request)  # literals: they add to the dynamic table
    assert not table_neutral(first)
    assert decoder.decode(first) == reference.decode(first, raw=True)
    again = encoder.encode(request)  # now all indexed, from the dynamic table
    assert table_neutral(again)
    assert decoder.decode(again) is decoder.decode(again)  # remembered
    assert decoder.decode(again) == [(k.encode(), v.encode()) for k, v in request]
    # A literal with incremental indexing shifts the table: the same bytes now name other
    # entries, so the remembered answer must not be given.
    other = encoder.encode([("x-other", "1")])
    decoder.decode(other)
    reference.decode(other, raw=True)
    assert decoder.decode(again) == reference.decode(again, raw=True)
    assert decoder.decode(again) != [(k.encode(), v.encode()) for k, v in request]
    assert table_neutral(bytes([0xFF, 0x80, 0x01]))  # index 255: a continued integer
    assert not table_neutral(bytes([0xFF, 0x80]))  # cut inside the integer
    assert not table_neutral(b"\x82\x40")  # an indexed field, then a literal
    assert not table_neutral(b"\x82\x3f\xe1\x1f")  # a table size update


def test_literals_without_indexing_are_remembered_as_envoy_sends_them() -> None:
    """Envoy sends `:path` (and values it will not index) as literals without indexing: the
    same bytes on every stream, decoded once."""
    encoder = hpack.Encoder()
    decoder, reference = HeaderDecoder(16_384), hpack.Decoder()
    indexed = encoder.encode([(":method", "POST"), ("x-token", "secret")])
    decoder.decode(indexed)
    reference.decode(indexed, raw=True)
    path = hpack.NeverIndexedHeaderTuple(":path", PATH)
    for huffman in (True, False):
        block = encoder.encode([(":method", "POST"), path, ("x-token", "secret")], huffman)
        block += b"\x00\x03x-a\x01b"  # a literal without indexing, with a new name
        assert table_neutral(block)
        assert decoder.decode(block) is decoder.decode(block)
        assert decoder.decode(block) == reference.decode(block, raw=True)
        assert decoder.decode(block)[1] == (b":path", PATH.encode())
    assert not table_neutral(b"\x04\x85ab")  # cut inside the value
    assert not table_neutral(b"\x00\x7f")  # cut inside a long name's length
    long_value = b"\x04\x7f\x01" + b"v" * 128  # length 127 + 1 as a continued integer
    assert table_neutral(long_value)
    assert not table_neutral(long_value[:-1])


def test_the_message_reader_joins_messages_cut_anywhere() -> None:
    """Messages split at every byte, the prefix included, several per feed or one across
    many: each comes out whole, once, in order."""
    messages = [b"", b"a", b"hello world" * 30, b"z" * 70_000]
    stream = b"".join(envelope(m) for m in messages)
    for cut in (1, 2, 3, 4, 5, 6, 7, 64, 16_384):
        reader = MessageReader(1 << 20)
        out = [m for at in range(0, len(stream), cut) for m in reader.feed(stream[at : at + cut])]
        assert out == messages, cut
    reader = MessageReader(1 << 20)
    assert reader.feed(stream) == messages  # all at once


def test_the_message_reader_refuses_at_the_prefix() -> None:
    """A message over the limit, or compressed, is refused once its prefix is read, before its
    bytes arrive."""
    reader = MessageReader(100)
    with pytest.raises(RpcError) as over:
        reader.feed(b"\x00\x00\x00\x00\x65" + b"x" * 10)
    assert over.value.code == RESOURCE_EXHAUSTED
    reader = MessageReader(100)
    assert reader.feed(b"\x01\x00") == []
    with pytest.raises(RpcError) as compressed:
        reader.feed(b"\x00\x00\x02ab")
    assert compressed.value.code == UNIMPLEMENTED


def test_a_block_that_fails_halfway_forgets_the_remembered_ones() -> None:
    """A malformed block may add to the table before it fails: what was remembered is not
    given again unless the table still says so."""
    encoder = hpack.Encoder()
    decoder, reference = HeaderDecoder(16_384), hpack.Decoder()
    for block in (encoder.encode([("x-token", "secret")]), encoder.encode([("x-token", "secret")])):
        assert decoder.decode(block) == reference.decode(block, raw=True)
    again = encoder.encode([("x-token", "secret")])  # remembered: one indexed field
    broken = encoder.encode([("x-new", "1")]) + b"\x40\x85"  # a literal added, then cut short
    for each in (decoder.decode, lambda b: reference.decode(b, raw=True)):
        with pytest.raises(hpack.HPACKError):
            each(broken)
    assert decoder.decode(again) == reference.decode(again, raw=True)
