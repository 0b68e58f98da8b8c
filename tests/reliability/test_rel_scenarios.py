"""Checklist scenarios not covered elsewhere, against a real Envoy with our bootstrap:
E1 slowloris, D5 client disconnect cancels the upstream, D6 a client that stops reading,
D8 hop-by-hop headers from a model server, F5 body URLs never used for routing."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from poolkeeper.requestcontrol.types import IncomingRequest
from tests.reliability.rel_harness import gate, stalled_reader, status_of
from tests.requestcontrol.test_rc_director import ALL, _rig

pytestmark = pytest.mark.integration


async def _until(condition: Callable[[], bool], timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def test_e1_slowloris_headers_are_cut_at_the_deadline(tmp_path: Path) -> None:
    """Headers trickled one byte at a time are cut at request_headers_timeout (1 s here, 10 s
    by default); a normal client is served meanwhile."""
    async with gate(tmp_path, request_headers_timeout_s=1.0) as g:
        reader, writer = await asyncio.open_connection("127.0.0.1", g.port)
        head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-slow: " + b"a" * 200
        closed = False
        got = b""
        async with aiohttp.ClientSession() as session:
            for i, byte in enumerate(head):
                try:
                    writer.write(bytes([byte]))
                    await writer.drain()
                except ConnectionError:
                    closed = True
                    break
                if i == 5:
                    async with session.post(
                        g.url + "/v1/chat/completions", json={"model": "m"}
                    ) as resp:
                        assert resp.status == 200  # others are unaffected
                try:
                    got = await asyncio.wait_for(reader.read(1024), 0.02)  # the trickle's pace
                except TimeoutError:
                    continue
                closed = True
                break
        writer.close()
        assert closed, "a trickled header was never cut"
        assert status_of(got) in (0, 408), got[:100]
        assert g.router.turn == 1  # only the normal client reached the EPP


async def test_d5_client_disconnect_mid_stream_reaches_the_server(tmp_path: Path) -> None:
    """A client that goes away mid-stream makes Envoy close the upstream request, and the EPP
    releases the request (499) once."""
    aborted = asyncio.Event()

    async def endless(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        _small_buffer(request.transport, socket.SO_SNDBUF)
        await resp.prepare(request)
        try:
            for _ in range(600):
                await resp.write(b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n')
                await asyncio.sleep(0.05)  # the server's token pace
        except (ConnectionError, asyncio.CancelledError):
            aborted.set()
            raise
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", endless)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with gate(tmp_path, fixed=(f"127.0.0.1:{port}",)) as g:
            async with (
                aiohttp.ClientSession() as session,
                session.post(
                    g.url + "/v1/chat/completions", json={"model": "m", "stream": True}
                ) as resp,
            ):
                await resp.content.readuntil(b"\n\n")
            await _until(aborted.is_set)
            await _until(lambda: len(g.router.completed) == 1)
            assert g.router.completed[0][0] == 499
    finally:
        await runner.cleanup()


async def test_d8_hop_by_hop_headers_from_the_server_are_dropped(tmp_path: Path) -> None:
    async def hop(request: web.Request) -> web.StreamResponse:
        await request.read()
        return web.Response(
            body=b'{"ok": true}',
            headers={
                "content-type": "application/json",
                "connection": "x-secret, keep-alive",
                "x-secret": "1",
                "keep-alive": "timeout=5",
                "proxy-connection": "close",
                "upgrade": "h2c",
            },
        )

    app = web.Application()
    app.router.add_post("/v1/chat/completions", hop)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with (
            gate(tmp_path, fixed=(f"127.0.0.1:{port}",)) as g,
            aiohttp.ClientSession() as session,
            session.post(g.url + "/v1/chat/completions", json={"model": "m"}) as resp,
        ):
            assert resp.status == 200
            assert json.loads(await resp.read()) == {"ok": True}
            for name in ("keep-alive", "proxy-connection", "upgrade"):
                assert name not in resp.headers, name
    finally:
        await runner.cleanup()


def _small_buffer(transport: asyncio.BaseTransport | None, option: int) -> None:
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, option, 1 << 16)


async def test_d6_a_client_that_stops_reading_is_bounded(tmp_path: Path) -> None:
    """A client that never reads a fast stream: Envoy stops reading from the server once its
    per-connection buffer is full (backpressure), and the stream idle timeout ends it."""
    sent = [0]
    done = asyncio.Event()

    async def firehose(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        _small_buffer(request.transport, socket.SO_SNDBUF)  # not Envoy's: pinned (below)
        await resp.prepare(request)
        chunk = b"data: " + b"x" * 16_000 + b"\n\n"
        try:
            for _ in range(20_000):  # 320 MB if nothing pushed back
                await resp.write(chunk)
                sent[0] += len(chunk)
        except (ConnectionError, asyncio.CancelledError):
            pass
        done.set()
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", firehose)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    writer: asyncio.StreamWriter | None = None
    # Responses past the EPP (observe_responses, serve's default with its own Envoy): with
    # the response body streamed through the in-process EPP instead, the bytes in flight on
    # that gRPC side stream (HTTP/2 windows and the EPP's socket buffers, none of them Envoy's
    # limits) grow as the loaded EPP answers slower: 29-78 MB, over any bound derived here.
    try:
        async with gate(
            tmp_path,
            fixed=(f"127.0.0.1:{port}",),
            stream_idle_timeout_s=2.0,
            observe_responses=True,
        ) as g:
            try:
                # The kernel buffers that are not Envoy's are pinned small (the server's send
                # buffer above, the client's receive buffer here), so `sent` is Envoy's buffers
                # (the upstream's and the client connection's limits) plus its own sockets'
                # kernel buffers, pinned by the bootstrap too (client send, server receive).
                # Before they were pinned they autotuned up to tcp_wmem's and tcp_rmem's
                # maxima (4 and 32 MB here): 5-11 MB seen at load 4-10; pinned, 2.0 MB.
                writer = await stalled_reader(
                    g.port,
                    "/v1/chat/completions",
                    b'{"model": "m", "stream": true}',
                    receive_buffer=1 << 16,
                )
                await _until(lambda: sent[0] > 1_000_000)
                await _until(done.is_set, 30)  # the idle timeout ended it, the server saw so
                # Envoy's limits: the upstream connection's and the request's buffer, the client
                # connection's; each high watermark may be passed by a read, so twice that.
                p = g.params
                envoy = 2 * (2 * p.buffer_limit_bytes + p.connection_buffer_bytes)
                # Envoy's two sockets (the kernel doubles what is set), the two pinned ends and
                # the server's own write buffer (aiohttp's 64 KiB high watermark).
                kernel = 2 * (p.client_send_buffer_bytes + p.server_receive_buffer_bytes)
                kernel += 2 * (1 << 16) * 2 + (1 << 16)
                assert sent[0] < envoy + kernel, (sent[0], envoy, kernel)
                await _until(lambda: len(g.router.completed) == 1)
            finally:
                if writer is not None:
                    writer.close()
    finally:
        await runner.cleanup()


async def test_f5_body_urls_are_never_destinations() -> None:
    rig = _rig()
    body = {
        "model": "chat",
        "messages": [{"role": "user", "content": "hi"}],
        "api_base": "http://169.254.169.254:80",
        "base_url": "http://10.9.9.9:1",
        "extra_headers": {"x-gateway-destination-endpoint": "10.9.9.9:1"},
    }
    request = IncomingRequest("f5", "POST", "/v1/chat/completions", {}, json.dumps(body).encode())
    decision = await rig.director.route(request)
    assert set(decision.endpoints) <= ALL
