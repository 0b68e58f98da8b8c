"""What `poolkeeper serve`'s flags mean: the resource source (files, or the Kubernetes API
server with at most a GatewayConfig from `-f`), the runtime's `ServeOptions` (Kubernetes
mode's readiness and drain, `/metrics` auth), the ext_proc TLS settings, and the checks that
refuse an incomplete or contradictory choice (ConfigError)."""

from __future__ import annotations

import argparse
import os
import socket
from pathlib import Path
from typing import Any

from poolkeeper.config.gateway import GatewayConfig
from poolkeeper.controller.files import file_source
from poolkeeper.controller.kubernetes import KubeSettings, kubernetes_source, load_config
from poolkeeper.controller.kubernetes.client import KubeApi
from poolkeeper.controller.kubernetes.metricsauth import MetricsAuth
from poolkeeper.controller.resource_files import load_files
from poolkeeper.controller.source import SourceFactory
from poolkeeper.errors import ConfigError
from poolkeeper.extproc.tls import TlsSettings
from poolkeeper.extproc.tls_certs import TlsError
from poolkeeper.scheduling.replicasync.config import KEY_FIELD_CONTEXT
from poolkeeper.server.options import DEFAULT_DRAIN_TIMEOUT_S, ServeOptions


def tls_settings(args: argparse.Namespace) -> TlsSettings:
    """The ext_proc TLS settings for these flags; ConfigError for what cannot be served."""
    secure = args.kubernetes if args.secure_serving is None else args.secure_serving
    settings = TlsSettings(
        secure_serving=secure,
        cert_path=args.cert_path,
        enable_cert_reload=args.enable_cert_reload,
        tls_min_version=args.tls_min_version,
        tls_cipher_suites=tuple(c.strip() for c in args.tls_cipher_suites.split(",") if c.strip()),
        client_ca_file=args.client_ca_file,
    )
    try:
        settings.check()
    except TlsError as exc:
        raise ConfigError(str(exc)) from None
    if settings.client_ca_file is not None and not (args.kubernetes or args.no_envoy):
        # The Envoy serve runs reaches the EPP on loopback with a per-run token and has no
        # client certificate of the CA to present: refuse rather than fail every request.
        raise ConfigError(
            "--client-ca-file is for an EPP behind another host's Envoy (--kubernetes or "
            "--no-envoy); the Envoy serve runs presents no client certificate"
        )
    return settings


def check_workdir(workdir: Path | None, paths: list[str]) -> None:
    """Hot reload would read the bootstrap written there as a (bad) resource file."""
    for path in paths:
        if workdir is not None and workdir.resolve().is_relative_to(Path(path).resolve()):
            raise ConfigError(f"workdir {workdir} must not be inside the watched path {path}")


def resource_source(args: argparse.Namespace) -> SourceFactory:
    """Files, or the Kubernetes API server (ConfigError when the choice is incomplete)."""
    if not args.kubernetes:
        if not args.paths:
            raise ConfigError("no files given: pass -f PATH, or --kubernetes")
        for flag in ("kubeconfig", "namespace", "identity", "context"):
            if getattr(args, flag) is not None:
                raise ConfigError(f"--{flag} needs --kubernetes")
        if args.pools:
            raise ConfigError("--pool needs --kubernetes")
        return file_source(args.paths)
    gateway_config = None
    if args.paths:
        loaded = load_files(args.paths)
        if loaded.errors:
            raise ConfigError("invalid configuration:\n  " + "\n  ".join(loaded.errors))
        if loaded.pools or loaded.models:
            raise ConfigError(
                "with --kubernetes, InferencePools and InferenceModels come from the API "
                "server; -f may only hold a GatewayConfig"
            )
        gateway_config = loaded.gateway_config
    gateway_config = one_endpoint_unless_set(gateway_config)
    config = load_config(kubeconfig=args.kubeconfig, context=args.context)
    identity = args.identity or os.environ.get("POD_NAME") or socket.gethostname()
    settings = KubeSettings(
        namespace=args.namespace or config.namespace or "default",
        identity=identity,
        pool_names=tuple(args.pools),
        write_status=not args.no_status,
        lease_name=args.lease_name,
    )
    return kubernetes_source(settings, gateway_config, config)


def serve_options(args: argparse.Namespace, source: SourceFactory) -> ServeOptions:
    """The runtime's options for these flags (Kubernetes mode: no Envoy, readiness as
    upstream's, a drain timeout); ConfigError for a bad value."""
    return ServeOptions(
        source=source,
        run_envoy=not (args.no_envoy or args.kubernetes),
        envoy_path=args.envoy_path,
        workdir=args.workdir,
        envoy_concurrency=args.envoy_concurrency,
        drain_grace_s=args.drain_grace,
        ready_once_synced=args.kubernetes,
        # Kubernetes mode runs behind the cluster's Gateway, not poolkeeper's bootstrap.
        own_bootstrap=not args.kubernetes,
        drain_timeout_s=_drain_timeout(args),
        tls=tls_settings(args),
        metrics_middlewares=_metrics_auth(args),
    )


def _metrics_auth(args: argparse.Namespace) -> tuple[Any, ...]:
    if not args.metrics_endpoint_auth:
        return ()
    if not args.kubernetes:
        raise ConfigError("--metrics-endpoint-auth needs --kubernetes (the API server decides)")
    config = load_config(kubeconfig=args.kubeconfig, context=args.context)
    namespace = args.namespace or config.namespace or "default"
    return (MetricsAuth(lambda: KubeApi(config, namespace)).middleware,)


def _drain_timeout(args: argparse.Namespace) -> float:
    if args.drain_timeout is not None:
        if args.drain_timeout < 0:
            raise ConfigError("--drain-timeout must be 0 or more seconds")
        return float(args.drain_timeout)
    return DEFAULT_DRAIN_TIMEOUT_S if args.kubernetes else 0.0


def one_endpoint_unless_set(config: GatewayConfig | None) -> GatewayConfig:
    """`serve --kubernetes` sends one endpoint unless `requestHandling.fallbackEndpoints` is
    set: the cluster's Gateway is not poolkeeper's Envoy, and gateways that route by the
    destination header alone (Envoy ORIGINAL_DST with use_http_header, as upstream's e2e
    config) answer 503 to a comma list. `serve` with its own Envoy keeps 3 fallbacks, which
    that Envoy retries on; so does `--no-envoy`, meant for the bootstrap `envoy-config`
    prints."""
    config = config if config is not None else GatewayConfig.default()
    if "fallback_endpoints" in config.spec.request_handling.model_fields_set:
        return config
    document = config.model_dump(by_alias=True, exclude_unset=True)
    document.setdefault("spec", {}).setdefault("requestHandling", {})["fallbackEndpoints"] = 0
    # (the context keeps where an EndpointPickerConfig wrote the sync key: its errors name it)
    at = {KEY_FIELD_CONTEXT: config.spec.replica_sync.key_field}
    return GatewayConfig.model_validate(document, context=at)
