"""The lean transport's stop closes connections still in their TLS handshake.

asyncio hides a TLS connection from its protocol until the handshake is done, so the lean
server's stop used to leave a client that connected and never finished its handshake alone:
its socket stayed open until asyncio's 60 s handshake timeout, whatever the drain grace. Now
the server holds such connections itself (`extproc/h2/handshakes.py`) and stop closes them at
once. On asyncio's loop and on uvloop, which `serve` may run (`--event-loop`)."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import grpc
import pytest

from poolkeeper.extproc.h2.server import tls_context
from poolkeeper.extproc.lean import start_lean
from poolkeeper.extproc.server import ExtProcServicer
from poolkeeper.extproc.tls_certs import self_signed_pair
from tests.extproc.extproc_fakes import FakeRouter
from tests.extproc.test_extproc_tls import route_once
from tests.support.waiting import until

pytestmark = pytest.mark.integration

CLIENT_HELLO_START = b"\x16\x03\x01\x02\x00\x01"  # a record header and a hello's first byte


async def _eof_or_reset(reader: asyncio.StreamReader) -> bytes:
    try:
        return await reader.read()
    except ConnectionResetError:
        return b""


async def _stalled_handshakes_are_closed_by_stop(tmp_path: Path) -> None:
    cert, key = self_signed_pair()
    (tmp_path / "tls.crt").write_bytes(cert)
    (tmp_path / "tls.key").write_bytes(key)
    context = tls_context(str(tmp_path / "tls.crt"), str(tmp_path / "tls.key"))
    server = await start_lean(ExtProcServicer(FakeRouter()), "127.0.0.1", 0, tls=context)
    stalled = []
    try:
        # A complete handshake still serves, beside the stalled ones.
        credentials = grpc.ssl_channel_credentials(root_certificates=cert)
        async with grpc.aio.secure_channel(f"localhost:{server.port}", credentials) as channel:
            assert await route_once(channel)
        # A client gone during its handshake is forgotten at once, not at the timeout.
        _, gone = await asyncio.open_connection("127.0.0.1", server.port)
        await until(lambda: server.handshakes_in_progress == 1, "a handshake under way")
        gone.close()
        await until(lambda: server.handshakes_in_progress == 0, "the gone client forgotten")
        for first_bytes in (b"", CLIENT_HELLO_START):  # silent; a hello never finished
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(first_bytes)
            stalled.append((asyncio.create_task(_eof_or_reset(reader)), writer))
        await until(lambda: server.handshakes_in_progress == 2, "both handshakes under way")
        await server.stop(30)
        await until(
            lambda: all(task.done() for task, _ in stalled), "stalled connections closed by stop"
        )
        assert [task.result() for task, _ in stalled] == [b"", b""]  # nothing was served
        assert server.handshakes_in_progress == 0
    finally:
        await server.stop(None)
        for task, writer in stalled:
            task.cancel()
            writer.close()


async def test_stop_closes_connections_still_in_their_tls_handshake(tmp_path: Path) -> None:
    await _stalled_handshakes_are_closed_by_stop(tmp_path)


def test_stop_closes_stalled_handshakes_on_uvloop_too(tmp_path: Path) -> None:
    uvloop = pytest.importorskip("uvloop")
    run: Callable[[Coroutine[Any, Any, None]], None] = uvloop.run
    run(_stalled_handshakes_are_closed_by_stop(tmp_path))


async def _handshakes_keep_the_first_bytes(tmp_path: Path, count: int = 30) -> None:
    """Clients that send their ClientHello at once, as every TLS client does: each handshake
    completes. An upgrade with `loop.start_tls` lost that first flight on uvloop (it reads
    before the upgrade could pause it) in about one connection in four, and the handshake
    stalled until the client gave up."""
    cert, key = self_signed_pair()
    (tmp_path / "tls.crt").write_bytes(cert)
    (tmp_path / "tls.key").write_bytes(key)
    server_context = tls_context(str(tmp_path / "tls.crt"), str(tmp_path / "tls.key"))
    server = await start_lean(ExtProcServicer(FakeRouter()), "127.0.0.1", 0, tls=server_context)
    client_context = ssl.create_default_context(cadata=cert.decode())
    client_context.set_alpn_protocols(["h2"])
    try:
        for _ in range(count):
            _reader, writer = await asyncio.wait_for(
                asyncio.open_connection(
                    "localhost", server.port, ssl=client_context, ssl_handshake_timeout=10
                ),
                10,
            )
            try:
                assert writer.get_extra_info("ssl_object").selected_alpn_protocol() == "h2"
            finally:
                writer.close()
    finally:
        await server.stop(None)


def test_handshakes_keep_the_client_hello_on_uvloop(tmp_path: Path) -> None:
    uvloop = pytest.importorskip("uvloop")
    run: Callable[[Coroutine[Any, Any, None]], None] = uvloop.run
    run(_handshakes_keep_the_first_bytes(tmp_path))


async def test_handshakes_keep_the_client_hello(tmp_path: Path) -> None:
    await _handshakes_keep_the_first_bytes(tmp_path)
