"""ext_proc over TLS (`extproc.tls`): a grpcio client, ALPN h2, certificates from a directory,
reload on change, and the settings that cannot be served; on both transports (grpcio's
credentials, the lean transport's stdlib `ssl` context)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from poolkeeper.extproc.lean import start_lean
from poolkeeper.extproc.server import ExtProcServicer, build_server
from poolkeeper.extproc.tls import TlsSettings, server_credentials, ssl_context
from poolkeeper.extproc.tls_certs import (
    CERT_FILE,
    KEY_FILE,
    CertReloader,
    TlsError,
    self_signed_pair,
)
from tests.extproc.extproc_fakes import PODS, FakeEnvoy, FakeRouter, headers_msg

DEST = "x-gateway-destination-endpoint"


@contextlib.asynccontextmanager
async def serving(settings: TlsSettings, transport: str = "grpcio") -> AsyncIterator[int]:
    if transport == "lean":
        lean = await start_lean(
            ExtProcServicer(FakeRouter()), "127.0.0.1", 0, tls=ssl_context(settings)
        )
        try:
            yield lean.port
        finally:
            await lean.stop(None)
        return
    server, port = build_server(
        ExtProcServicer(FakeRouter()), "127.0.0.1:0", credentials=server_credentials(settings)
    )
    await server.start()
    try:
        yield port
    finally:
        await server.stop(None)


async def route_once(channel: grpc.aio.Channel) -> str:
    """One header-only request through the ext_proc stream; the destination the EPP names."""
    call = FakeEnvoy(channel).open()
    await call.write(headers_msg({":method": "GET", ":path": "/health"}, eos=True))
    reply = await call.read()
    call.cancel()
    assert not isinstance(reply, type(grpc.aio.EOF))
    mutation = reply.request_headers.response.header_mutation
    headers = {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}
    return str(headers[DEST])


def served_certificate(port: int) -> tuple[bytes, str | None]:
    """(DER of the certificate the server presents, the ALPN protocol it selected)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        context.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
        assert der is not None
        return der, tls.selected_alpn_protocol()


def pem_to_der(pem: bytes) -> bytes:
    return ssl.PEM_cert_to_DER_cert(pem.decode())


def write_pair(directory: Path, cert: bytes, key: bytes) -> None:
    """As a Secret update lands: each file replaced whole (rename), key first."""
    for name, data in ((KEY_FILE, key), (CERT_FILE, cert)):
        tmp = directory / f".{name}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, directory / name)


async def test_ext_proc_over_tls_with_a_self_signed_certificate(transport: str) -> None:
    async with serving(TlsSettings(secure_serving=True), transport) as port:
        der, alpn = await asyncio.to_thread(served_certificate, port)
        assert alpn == "h2"
        # A client that pins the served certificate routes through it.
        pem = ssl.DER_cert_to_PEM_cert(der).encode()
        creds = grpc.ssl_channel_credentials(root_certificates=pem)
        async with grpc.aio.secure_channel(f"localhost:{port}", creds) as channel:
            assert await route_once(channel) == PODS[0]
        # Plaintext gRPC cannot talk to it.
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError):
                await asyncio.wait_for(route_once(channel), timeout=10)


async def test_plaintext_is_the_default(transport: str) -> None:
    assert TlsSettings().secure_serving is False
    assert server_credentials(TlsSettings()) is None
    assert ssl_context(TlsSettings()) is None
    async with (
        serving(TlsSettings(), transport) as port,
        grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel,
    ):
        assert await route_once(channel) == PODS[0]


async def test_a_certificate_directory_is_served(tmp_path: Path, transport: str) -> None:
    cert, key = self_signed_pair()
    write_pair(tmp_path, cert, key)
    async with serving(TlsSettings(secure_serving=True, cert_path=tmp_path), transport) as port:
        der, _ = await asyncio.to_thread(served_certificate, port)
        assert der == pem_to_der(cert)
        creds = grpc.ssl_channel_credentials(root_certificates=cert)
        async with grpc.aio.secure_channel(f"localhost:{port}", creds) as channel:
            assert await route_once(channel) == PODS[0]


async def test_a_changed_certificate_is_served_on_the_next_connection(
    tmp_path: Path, transport: str
) -> None:
    old_cert, old_key = self_signed_pair()
    new_cert, new_key = self_signed_pair()
    write_pair(tmp_path, old_cert, old_key)
    settings = TlsSettings(secure_serving=True, cert_path=tmp_path, enable_cert_reload=True)
    async with serving(settings, transport) as port:
        der, _ = await asyncio.to_thread(served_certificate, port)
        assert der == pem_to_der(old_cert)
        write_pair(tmp_path, new_cert, new_key)
        # gRPC asks for the pair at each new connection: poll connections, bounded (10 s, loose
        # for a loaded machine: the old pair would be served for ever, not late).
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10.0
        while (await asyncio.to_thread(served_certificate, port))[0] != pem_to_der(new_cert):
            assert loop.time() < deadline, "the new certificate was not served within 10 s"
        creds = grpc.ssl_channel_credentials(root_certificates=new_cert)
        async with grpc.aio.secure_channel(f"localhost:{port}", creds) as channel:
            assert await route_once(channel) == PODS[0]


def test_a_half_written_pair_keeps_the_previous_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cert, key = self_signed_pair()
    other_cert, other_key = self_signed_pair()
    write_pair(tmp_path, cert, key)
    reloader = CertReloader(tmp_path)
    assert reloader.fetch() is None  # unchanged
    (tmp_path / CERT_FILE).write_bytes(other_cert)  # the key not yet replaced
    assert reloader.fetch() is None
    assert reloader.pair == (cert, key)
    assert "is not the key of" in caplog.text
    caplog.clear()
    assert reloader.fetch() is None  # logged once per change
    assert not caplog.text
    (tmp_path / KEY_FILE).write_bytes(other_key)
    assert reloader.fetch() is not None
    assert reloader.pair == (other_cert, other_key)
    assert reloader.reloads == 1


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (TlsSettings(secure_serving=True, enable_cert_reload=True), "needs --cert-path"),
        (TlsSettings(cert_path=Path("/x")), "--cert-path needs --secure-serving"),
        (TlsSettings(secure_serving=True, tls_min_version="TLS12"), "expected one of"),
        (TlsSettings(secure_serving=True, tls_min_version="VersionTLS13"), "cannot refuse"),
        (
            TlsSettings(secure_serving=True, tls_cipher_suites=("TLS_AES_128_GCM_SHA256",)),
            "no cipher",
        ),
    ],
)
def test_settings_that_cannot_be_served_are_refused(settings: TlsSettings, message: str) -> None:
    with pytest.raises(TlsError, match=message):
        server_credentials(settings)


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({}, "cannot read the TLS pair"),
        ({CERT_FILE: b"nope", KEY_FILE: b"nope"}, "tls.crt: not a PEM certificate"),
    ],
)
def test_a_bad_certificate_directory_is_a_precise_error(
    tmp_path: Path, files: dict[str, bytes], message: str
) -> None:
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    with pytest.raises(TlsError, match=message):
        server_credentials(TlsSettings(secure_serving=True, cert_path=tmp_path))


def test_tls_min_version_up_to_12_is_served_as_12_and_up() -> None:
    for version in ("VersionTLS10", "VersionTLS11", "VersionTLS12"):
        assert server_credentials(TlsSettings(secure_serving=True, tls_min_version=version))
