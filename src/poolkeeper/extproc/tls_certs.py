"""The ext_proc server's certificates: made at start, read from a directory, reloaded on change.

`self_signed_pair` makes the certificate served without `cert_path` (ECDSA P-256, ten years, the
SANs `localhost` and `127.0.0.1`); `read_pair` reads `tls.crt` and `tls.key` from a directory
(a Kubernetes TLS Secret's keys) and checks they belong together; `read_client_ca` the
`--client-ca-file` bundle; `CertReloader` is the fetcher of gRPC's dynamic server credentials
(`enable_cert_reload`). Each refuses what cannot be served with a `TlsError` naming the file or
flag. extproc/tls.py decides from the settings which of them a port serves.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
from pathlib import Path
from typing import Final

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

# The logger these functions had in extproc/tls.py (the reload's warnings and info).
log = logging.getLogger("poolkeeper.extproc.tls")

CERT_FILE: Final = "tls.crt"
KEY_FILE: Final = "tls.key"
_VALIDITY: Final = datetime.timedelta(days=3650)


class TlsError(ValueError):
    """A TLS setting or certificate that cannot be served (the message says which and why)."""


def self_signed_pair(hosts: tuple[str, ...] = ("localhost", "127.0.0.1")) -> tuple[bytes, bytes]:
    """A fresh self-signed server certificate and its key, PEM: (cert, key)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Inference Ext"),
            x509.NameAttribute(NameOID.COMMON_NAME, hosts[0] if hosts else "poolkeeper"),
        ]
    )
    sans: list[x509.GeneralName] = []
    for host in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            sans.append(x509.DNSName(host))
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # clock skew between hosts
        .not_valid_after(now + _VALIDITY)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(key, hashes.SHA256())
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def read_pair(directory: Path) -> tuple[bytes, bytes]:
    """(cert, key) PEM from `directory`; TlsError unless both parse and belong together."""
    cert_file, key_file = directory / CERT_FILE, directory / KEY_FILE
    try:
        cert_pem, key_pem = cert_file.read_bytes(), key_file.read_bytes()
    except OSError as exc:
        raise TlsError(f"cannot read the TLS pair in {directory}: {exc}") from None
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError as exc:
        raise TlsError(f"{cert_file}: not a PEM certificate ({exc})") from None
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as exc:
        raise TlsError(f"{key_file}: not an unencrypted PEM private key ({exc})") from None
    raw = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if cert.public_key().public_bytes(*raw) != key.public_key().public_bytes(*raw):
        raise TlsError(f"{key_file} is not the key of {cert_file}")
    return cert_pem, key_pem


def read_client_ca(path: Path) -> bytes:
    """The PEM CA bundle `--client-ca-file` names; TlsError unless it holds a certificate."""
    try:
        pem = path.read_bytes()
    except OSError as exc:
        raise TlsError(f"--client-ca-file {path}: cannot read it ({exc.strerror})") from None
    try:
        certificates = x509.load_pem_x509_certificates(pem)
    except ValueError:
        certificates = []
    if not certificates:
        raise TlsError(f"--client-ca-file {path}: holds no PEM CA certificate")
    return pem


def _stamp(directory: Path) -> tuple[tuple[int, int, int], ...]:
    """What changes when either file is rewritten or swapped (mtime, size, inode)."""
    out = []
    for name in (CERT_FILE, KEY_FILE):
        try:
            st = os.stat(directory / name)
        except OSError:
            out.append((-1, -1, -1))
        else:
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
    return tuple(out)


class CertReloader:
    """The certificate fetcher of gRPC's dynamic server credentials (called per connection)."""

    def __init__(self, directory: Path, client_ca: bytes | None = None) -> None:
        self.directory = directory
        self.client_ca = client_ca  # root certificates client certificates must chain to
        self._stamp = _stamp(directory)
        self.pair = read_pair(directory)
        self.reloads = 0
        self._rejected: tuple[tuple[int, int, int], ...] | None = None

    def configuration(self) -> grpc.ServerCertificateConfiguration:
        cert, key = self.pair
        return grpc.ssl_server_certificate_configuration([(key, cert)], self.client_ca)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """The new configuration when the files changed into a valid pair, else None (keep)."""
        stamp = _stamp(self.directory)
        if stamp == self._stamp or stamp == self._rejected:
            return None
        try:
            pair = read_pair(self.directory)
        except TlsError as exc:
            self._rejected = stamp  # once per change: the next write is looked at again
            log.warning("TLS pair not reloaded, still serving the previous one: %s", exc)
            return None
        self._stamp, self.pair, self._rejected = stamp, pair, None
        self.reloads += 1
        log.info("TLS certificate reloaded from %s", self.directory)
        return self.configuration()
