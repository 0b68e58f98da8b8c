"""TLS for the ext_proc gRPC server, as upstream's EPP serves it (`--secure-serving`).

`server_credentials(TlsSettings)` is the one function a grpcio server calls: None means
plaintext (`add_insecure_port`), else grpc server credentials for `add_secure_port`. gRPC
negotiates ALPN `h2` itself. `ssl_context(TlsSettings)` is the same for the lean transport
(stdlib `ssl`, ALPN h2), with the same certificate choices and floor.

- No `cert_path`: a self-signed certificate made at start (upstream does the same: RSA-4096, ten
  years, O="Inference Ext", no SANs). Here ECDSA P-256 (generated in milliseconds, not seconds)
  with the SANs `localhost` and `127.0.0.1`, so that a verifying client on the same host can
  pin it; gateways in front of an EPP skip verification either way (upstream's Istio
  DestinationRule says `insecureSkipVerify`).
- `cert_path`: a directory with `tls.crt` and `tls.key` (a Kubernetes TLS Secret's keys).
- `enable_cert_reload`: gRPC's dynamic server credentials ask `CertReloader.fetch` at every new
  connection; it re-reads the pair when either file changed (a Secret update swaps the files
  behind a symlink), so a new handshake serves the new certificate at once. A half-written or
  mismatched pair is logged and the previous one kept until the files agree again.
- `client_ca_file` (`--client-ca-file`, poolkeeper's own: upstream's EPP has no such flag):
  mutual TLS. The port then requires a client certificate that chains to a CA in that PEM file
  and refuses the handshake otherwise (no certificate, another CA's, an expired one), so only
  the Envoy given such a certificate can reach the EPP. The file is read once at start (cert
  reload covers tls.crt and tls.key, not the CA); a missing, unreadable or certificate-less
  file is refused with the flag and file named.
- `tls_min_version`: upstream's Go names. grpcio's floor is TLS 1.2 and it offers no setting,
  so `VersionTLS10`-`12` are served as 1.2+ (stricter); `VersionTLS13` and cipher suites
  cannot be enforced through grpcio and are refused with a precise error rather than ignored.

The certificates themselves (made, read, reloaded) are extproc/tls_certs.py's; `__all__` keeps
this module the one import of both.
"""

from __future__ import annotations

import logging
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import grpc

from poolkeeper.extproc.h2.server import tls_context
from poolkeeper.extproc.tls_certs import (
    CERT_FILE,
    KEY_FILE,
    CertReloader,
    TlsError,
    read_client_ca,
    read_pair,
    self_signed_pair,
)

__all__ = [
    "CERT_FILE",
    "KEY_FILE",
    "TLS_VERSIONS",
    "CertReloader",
    "TlsError",
    "TlsSettings",
    "read_client_ca",
    "read_pair",
    "self_signed_pair",
    "server_credentials",
    "ssl_context",
]

log = logging.getLogger(__name__)

TLS_VERSIONS: Final = ("VersionTLS10", "VersionTLS11", "VersionTLS12", "VersionTLS13")
_ENFORCEABLE: Final = frozenset({"", "VersionTLS10", "VersionTLS11", "VersionTLS12"})


@dataclass(frozen=True, slots=True)
class TlsSettings:
    """How the ext_proc server is served; upstream's flags of the same names."""

    secure_serving: bool = False  # `serve` on one machine: loopback plaintext unless asked
    cert_path: Path | None = None  # a directory with tls.crt and tls.key
    enable_cert_reload: bool = False  # needs cert_path
    tls_min_version: str = ""  # "" or one of TLS_VERSIONS
    tls_cipher_suites: tuple[str, ...] = ()
    client_ca_file: Path | None = None  # require client certificates chained to this CA

    def check(self) -> None:
        """Raise TlsError for a combination that cannot be served."""
        if self.enable_cert_reload and self.cert_path is None:
            raise TlsError(
                "--enable-cert-reload needs --cert-path (a self-signed cert never changes)"
            )
        if self.tls_min_version not in ("", *TLS_VERSIONS):
            raise TlsError(
                f"--tls-min-version {self.tls_min_version!r}: expected one of "
                + ", ".join(TLS_VERSIONS)
            )
        if self.tls_min_version not in _ENFORCEABLE:
            raise TlsError(
                f"--tls-min-version {self.tls_min_version}: grpcio cannot refuse TLS 1.2 "
                "(it serves TLS 1.2 and 1.3 with no setting); leave it unset or VersionTLS12"
            )
        if self.tls_cipher_suites:
            raise TlsError(
                "--tls-cipher-suites: grpcio offers no cipher setting (it serves BoringSSL's "
                "ECDHE AES-GCM and ChaCha20 suites); leave it unset"
            )
        if self.cert_path is not None and not self.secure_serving:
            raise TlsError("--cert-path needs --secure-serving")
        if self.client_ca_file is not None:
            if not self.secure_serving:
                raise TlsError("--client-ca-file needs --secure-serving (mutual TLS is TLS)")
            read_client_ca(self.client_ca_file)

    def client_ca(self) -> bytes | None:
        """The client CA bundle (PEM) to verify client certificates against, or None."""
        return None if self.client_ca_file is None else read_client_ca(self.client_ca_file)


def server_credentials(settings: TlsSettings) -> grpc.ServerCredentials | None:
    """Credentials for the ext_proc port, or None for plaintext; TlsError if unservable."""
    settings.check()
    if not settings.secure_serving:
        return None
    ca = settings.client_ca()
    _log_client_auth(settings)
    if settings.cert_path is None:
        cert, key = self_signed_pair()
        log.info("ext_proc serves TLS with a self-signed certificate made at start")
        return grpc.ssl_server_credentials([(key, cert)], ca, require_client_auth=ca is not None)
    if settings.enable_cert_reload:
        reloader = CertReloader(settings.cert_path, ca)
        log.info("ext_proc serves TLS from %s, reloaded on change", settings.cert_path)
        return grpc.dynamic_ssl_server_credentials(
            reloader.configuration(),
            reloader.fetch,
            require_client_authentication=ca is not None,
        )
    cert, key = read_pair(settings.cert_path)
    log.info("ext_proc serves TLS from %s", settings.cert_path)
    return grpc.ssl_server_credentials([(key, cert)], ca, require_client_auth=ca is not None)


def _log_client_auth(settings: TlsSettings) -> None:
    if settings.client_ca_file is not None:
        log.info("ext_proc requires client certificates from the CA in %s", settings.client_ca_file)


def _h2_context(pair: tuple[bytes, bytes], client_ca: bytes | None = None) -> ssl.SSLContext:
    """The lean transport's server context (`h2.server.tls_context`) serving the PEM `pair`;
    with `client_ca`, a handshake without a client certificate chained to it fails."""
    context = _serving_context(pair)
    if client_ca is not None:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(cadata=client_ca.decode("ascii", "replace"))
    return context


def _serving_context(pair: tuple[bytes, bytes]) -> ssl.SSLContext:
    # The ssl module loads a chain from files only: a private directory, gone at once.
    with tempfile.TemporaryDirectory(prefix="poolkeeper-tls-") as tmp:
        cert_file, key_file = Path(tmp) / CERT_FILE, Path(tmp) / KEY_FILE
        cert_file.write_bytes(pair[0])
        key_file.touch(mode=0o600)
        key_file.write_bytes(pair[1])
        return tls_context(str(cert_file), str(key_file))


def ssl_context(settings: TlsSettings) -> ssl.SSLContext | None:
    """`server_credentials` for the lean transport (stdlib `ssl`): the same certificate
    choices, the same floor (TLS 1.2), ALPN h2; None for plaintext. With cert reload, each new
    handshake looks at the files (as grpcio's dynamic credentials do) and serves the new pair
    once the files hold a valid one."""
    settings.check()
    if not settings.secure_serving:
        return None
    ca = settings.client_ca()
    _log_client_auth(settings)
    if settings.cert_path is None:
        log.info("ext_proc serves TLS with a self-signed certificate made at start")
        return _h2_context(self_signed_pair(), ca)
    if not settings.enable_cert_reload:
        log.info("ext_proc serves TLS from %s", settings.cert_path)
        return _h2_context(read_pair(settings.cert_path), ca)
    reloader = CertReloader(settings.cert_path, ca)
    log.info("ext_proc serves TLS from %s, reloaded on change", settings.cert_path)
    current = [_h2_context(reloader.pair, ca)]

    def on_hello(connection: ssl.SSLObject, _name: str | None, _front: ssl.SSLContext) -> None:
        if reloader.fetch() is not None:
            current[0] = _h2_context(reloader.pair, ca)
        connection.context = current[0]

    # The front context decides client verification (OpenSSL keeps the handshake's verify
    # mode when the callback swaps the context), so it carries the CA as each swap does.
    front = _h2_context(reloader.pair, ca)
    front.sni_callback = on_hello
    return front
