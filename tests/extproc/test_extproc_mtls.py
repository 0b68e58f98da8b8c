"""Mutual TLS on the ext_proc port (`--client-ca-file`): a client certificate from the CA is
served; none, or one from another CA, fails the handshake; on both transports, with and
without cert reload; a bad CA file is a precise error."""

from __future__ import annotations

import asyncio
import datetime
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from poolkeeper.extproc.tls import TlsSettings, server_credentials
from poolkeeper.extproc.tls_certs import TlsError, self_signed_pair
from tests.extproc.extproc_fakes import PODS
from tests.extproc.test_extproc_tls import route_once, serving, write_pair


@dataclass(frozen=True)
class Issued:
    cert: bytes
    key: bytes


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def make_ca(common: str) -> tuple[Issued, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common))
        .issuer_name(_name(common))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return Issued(cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)), key


def issue_client(ca: Issued, ca_key: ec.EllipticCurvePrivateKey, common: str) -> Issued:
    key = ec.generate_private_key(ec.SECP256R1())
    issuer = x509.load_pem_x509_certificate(ca.cert).subject
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return Issued(cert.public_bytes(serialization.Encoding.PEM), _pem_key(key))


@dataclass(frozen=True)
class Pki:
    ca_file: Path
    trusted: Issued  # a client certificate from the CA in ca_file
    untrusted: Issued  # one from another CA


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    ca, ca_key = make_ca("envoy-client-ca")
    other, other_key = make_ca("some-other-ca")
    ca_file = tmp_path / "client-ca.crt"
    ca_file.write_bytes(ca.cert)
    return Pki(
        ca_file,
        issue_client(ca, ca_key, "envoy"),
        issue_client(other, other_key, "envoy"),
    )


async def route_as(port: int, server_cert: bytes, client: Issued | None) -> str:
    """One request over TLS pinning `server_cert`, presenting `client` (None: no certificate)."""
    creds = grpc.ssl_channel_credentials(
        root_certificates=server_cert,
        private_key=client.key if client else None,
        certificate_chain=client.cert if client else None,
    )
    async with grpc.aio.secure_channel(f"localhost:{port}", creds) as channel:
        return await asyncio.wait_for(route_once(channel), timeout=10)


def handshake(port: int, server_cert: bytes, client: Issued | None, tmp: Path) -> None:
    """A TLS 1.2 handshake presenting `client`; raises ssl.SSLError when the server refuses.

    A plain socket rather than grpc: a refused grpc channel reconnects on its own, and an
    attempt still mid-handshake when the server stops is a leaked socket. TLS 1.2 because
    there the server checks the client certificate before its Finished, so the refusal is
    the handshake's own error (with 1.3 it comes as an alert after the client's handshake)."""
    context = ssl.create_default_context(cadata=server_cert.decode())
    context.maximum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["h2"])
    if client is not None:
        (tmp / "client.crt").write_bytes(client.cert)
        (tmp / "client.key").write_bytes(client.key)
        context.load_cert_chain(tmp / "client.crt", tmp / "client.key")
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        context.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        assert tls.selected_alpn_protocol() == "h2"


@pytest.mark.parametrize("reload", [False, True], ids=["static", "reload"])
async def test_only_a_client_certificate_from_the_ca_is_served(
    tmp_path: Path, pki: Pki, transport: str, reload: bool
) -> None:
    server_cert, server_key = self_signed_pair()
    certs = tmp_path / "certs"
    certs.mkdir()
    write_pair(certs, server_cert, server_key)
    settings = TlsSettings(
        secure_serving=True,
        cert_path=certs,
        enable_cert_reload=reload,
        client_ca_file=pki.ca_file,
    )
    async with serving(settings, transport) as port:
        assert await route_as(port, server_cert, pki.trusted) == PODS[0]
        await asyncio.to_thread(handshake, port, server_cert, pki.trusted, tmp_path)
        for refused in (None, pki.untrusted):  # no certificate; another CA's
            with pytest.raises(ssl.SSLError):
                await asyncio.to_thread(handshake, port, server_cert, refused, tmp_path)
        # The refusals left the port serving.
        assert await route_as(port, server_cert, pki.trusted) == PODS[0]


async def test_without_the_option_no_client_certificate_is_asked(
    tmp_path: Path, transport: str
) -> None:
    server_cert, server_key = self_signed_pair()
    write_pair(tmp_path, server_cert, server_key)
    async with serving(TlsSettings(secure_serving=True, cert_path=tmp_path), transport) as port:
        assert await route_as(port, server_cert, None) == PODS[0]
        await asyncio.to_thread(handshake, port, server_cert, None, tmp_path)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, r"--client-ca-file .*missing\.crt: cannot read it \(No such file"),
        (b"not a certificate\n", r"--client-ca-file .*missing\.crt: holds no PEM CA"),
        (b"", r"--client-ca-file .*missing\.crt: holds no PEM CA"),
    ],
    ids=["missing", "garbage", "empty"],
)
def test_a_bad_client_ca_file_is_a_precise_error(
    tmp_path: Path, content: bytes | None, message: str
) -> None:
    path = tmp_path / "missing.crt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(TlsError, match=message):
        server_credentials(TlsSettings(secure_serving=True, client_ca_file=path))


def test_a_client_ca_without_secure_serving_is_refused(pki: Pki) -> None:
    with pytest.raises(TlsError, match="--client-ca-file needs --secure-serving"):
        TlsSettings(client_ca_file=pki.ca_file).check()
