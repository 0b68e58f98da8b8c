"""`poolkeeper serve` (run the gateway: EPP + supervised Envoy) and `poolkeeper envoy-config`.

poolkeeper serve -f examples/                  # EPP + Envoy on listeners.http
poolkeeper serve -f pool.yaml --no-envoy       # EPP only, for your own Envoy / Gateway
poolkeeper serve --kubernetes --pool my-pool   # in a cluster: resources from the API server
                                               # (ext_proc over TLS, as upstream's EPP)
poolkeeper envoy-config -f examples/ > envoy.json && envoy -c envoy.json
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from poolkeeper.config.gateway import GatewayConfig
from poolkeeper.controller.files import FileResourceSource, file_source
from poolkeeper.controller.kubernetes import KubeSettings, kubernetes_source, load_config
from poolkeeper.controller.kubernetes.client import KubeApi
from poolkeeper.controller.kubernetes.metricsauth import MetricsAuth
from poolkeeper.controller.resource_files import load_files
from poolkeeper.controller.source import SourceFactory
from poolkeeper.datastore.store import Datastore
from poolkeeper.envoy.bootstrap import build_bootstrap, render
from poolkeeper.errors import ConfigError
from poolkeeper.extproc.heap import freeze_startup_objects
from poolkeeper.extproc.tls import TlsError, TlsSettings
from poolkeeper.scheduling.replicasync.config import KEY_FIELD_CONTEXT
from poolkeeper.server.envoy_bootstrap import bootstrap_params
from poolkeeper.server.options import DEFAULT_DRAIN_GRACE_S, DEFAULT_DRAIN_TIMEOUT_S, ServeOptions
from poolkeeper.server.runtime import GatewayRuntime
from poolkeeper.server.signals import serve_until_signalled
from poolkeeper.telemetry.logs import configure_logging


def _add_files(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    parser.add_argument(
        "-f",
        "--filename",
        dest="paths",
        action="extend",
        nargs="+",
        required=required,
        metavar="PATH",
        help="YAML/JSON files or directories with InferencePools, InferenceModels and an "
        "optional GatewayConfig (with --kubernetes: only the GatewayConfig)",
    )


def _add_kubernetes(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Kubernetes mode")
    group.add_argument(
        "--kubernetes",
        action="store_true",
        help="read pools, models and Pods from the Kubernetes API server and write model "
        "status (implies --no-envoy: the cluster's Gateway is the Envoy)",
    )
    group.add_argument(
        "--kubeconfig", type=Path, default=None, help="kubeconfig file (default: in-cluster)"
    )
    group.add_argument("--context", default=None, help="kubeconfig context")
    group.add_argument(
        "--namespace", default=None, help="namespace to watch (default: the pod's own)"
    )
    group.add_argument(
        "--pool",
        dest="pools",
        action="append",
        default=[],
        metavar="NAME",
        help="serve only this InferencePool (repeatable; default: every pool in the namespace)",
    )
    group.add_argument(
        "--identity",
        default=None,
        help="this replica's name for the Lease (default: $POD_NAME, else the host name)",
    )
    group.add_argument(
        "--lease-name", default="poolkeeper-epp", help="Lease for the status writer election"
    )
    group.add_argument("--no-status", action="store_true", help="never write InferenceModel status")
    group.add_argument(
        "--metrics-endpoint-auth",
        action="store_true",
        help="/metrics only for a bearer token the API server authenticates (TokenReview) "
        "and allows to get /metrics (SubjectAccessReview), as upstream's EPP; needs a "
        "ClusterRole to create both",
    )


def _add_tls(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("TLS on the ext_proc port (upstream's EPP flags)")
    group.add_argument(
        "--secure-serving",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="serve ext_proc over TLS, ALPN h2 (default: on with --kubernetes, as upstream's "
        "EPP; otherwise off, loopback plaintext to the managed Envoy)",
    )
    group.add_argument(
        "--cert-path",
        type=Path,
        default=None,
        help="directory with tls.crt and tls.key (default: a self-signed cert made at start)",
    )
    group.add_argument(
        "--enable-cert-reload",
        action="store_true",
        help="serve a changed tls.crt/tls.key from the next connection on (needs --cert-path)",
    )
    group.add_argument(
        "--client-ca-file",
        type=Path,
        default=None,
        help="mutual TLS: require a client certificate chained to a CA in this PEM file "
        "(poolkeeper's own flag; the EPP behind another host's Envoy: --kubernetes or "
        "--no-envoy)",
    )
    group.add_argument(
        "--tls-min-version",
        default="",
        help="VersionTLS10..VersionTLS12 (gRPC serves TLS 1.2 and up in any case)",
    )
    group.add_argument(
        "--tls-cipher-suites",
        default="",
        help="comma list (accepted for upstream's flag; grpcio cannot apply one: refused)",
    )


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


def register(subparsers: Any) -> None:
    serve: argparse.ArgumentParser = subparsers.add_parser(
        "serve",
        help="run the gateway: the endpoint picker and a supervised Envoy",
        description="Load pools, models and the GatewayConfig, start the endpoint picker "
        "(ext_proc, health, metrics) and Envoy in front of it. Ctrl-C drains and stops.",
    )
    _add_files(serve, required=False)
    _add_kubernetes(serve)
    _add_tls(serve)
    serve.add_argument("--envoy-path", default=None, help="Envoy binary to run")
    serve.add_argument(
        "--no-envoy", action="store_true", help="run only the endpoint picker (own Envoy)"
    )
    serve.add_argument(
        "--workdir", type=Path, default=None, help="where the bootstrap and Envoy log go"
    )
    serve.add_argument("--envoy-concurrency", type=int, default=1, help="Envoy worker threads")
    serve.add_argument(
        "--drain-grace",
        type=float,
        default=DEFAULT_DRAIN_GRACE_S,
        help="on SIGTERM: seconds accepted requests get to finish (130, as upstream's chart)",
    )
    serve.add_argument(
        "--drain-timeout",
        type=float,
        default=None,
        help="on SIGTERM: seconds ext_proc keeps taking new requests after readiness turned "
        "NOT_SERVING (default 30 with --kubernetes, as upstream's EPP; else 0)",
    )
    serve.add_argument("--log-level", default="info", help="debug, info, warning, error")
    serve.add_argument(
        "--log-format", choices=("json", "text"), default="json", help="log line format"
    )
    serve.add_argument(
        "--event-loop",
        choices=("uvloop", "asyncio"),
        default="uvloop",
        help="uvloop (default where installed): ~15-20%% more requests per EPP core",
    )
    serve.set_defaults(handler=run_serve)

    cfg: argparse.ArgumentParser = subparsers.add_parser(
        "envoy-config",
        help="print the Envoy bootstrap `serve` would run",
        description="Print the Envoy bootstrap (JSON, also valid YAML) for running your own "
        "Envoy in front of `poolkeeper serve --no-envoy`.",
    )
    _add_files(cfg)
    cfg.add_argument("-o", "--output", type=Path, default=None, help="write to a file")
    cfg.set_defaults(handler=run_envoy_config)


def _check_workdir(workdir: Path | None, paths: list[str]) -> None:
    """Hot reload would read the bootstrap written there as a (bad) resource file."""
    for path in paths:
        if workdir is not None and workdir.resolve().is_relative_to(Path(path).resolve()):
            raise ConfigError(f"workdir {workdir} must not be inside the watched path {path}")


def _source(args: argparse.Namespace) -> SourceFactory:
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


def loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop `serve` runs on: uvloop if asked for and installed (a dependency on
    Linux and macOS), else asyncio's own (None). Measured: gateway_overhead's closed loop
    served 1,238-1,286 requests per EPP core-second on uvloop against 1,076 on asyncio."""
    if name != "uvloop":
        return None
    try:
        import uvloop  # optional: not built for every platform
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def run_serve(args: argparse.Namespace) -> int:
    logs = configure_logging(args.log_level, json_lines=args.log_format == "json", queued=True)
    try:
        return _serve(args)
    finally:
        if logs is not None:
            logs.close()


def _serve(args: argparse.Namespace) -> int:
    try:
        options = serve_options(args, _source(args))
    except ConfigError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    try:
        _check_workdir(args.workdir, args.paths or [])
    except ConfigError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    return run_gateway(options, args.event_loop, json_logs=args.log_format == "json")


def run_gateway(options: ServeOptions, event_loop: str, *, json_logs: bool = False) -> int:
    """Run the gateway until a signal stops it (`serve`, `epp`): exit code 0, 1 or 2."""
    runtime = GatewayRuntime(options)

    async def main() -> None:
        started = asyncio.Event()
        task = asyncio.create_task(serve_until_signalled(runtime, started))
        waiter = asyncio.create_task(started.wait())
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if started.is_set():
            freeze_startup_objects()  # no full GC pass walks start-up's objects (heap.py)
            what = (
                f"poolkeeper gateway ready on {runtime.http_url}"
                if options.run_envoy
                else f"poolkeeper endpoint picker ready ({runtime.extproc_address})"
            )
            if json_logs:  # one format per stream: a log record, not a print
                logging.getLogger("poolkeeper.cli").info("%s", what)
            else:
                print(what, file=sys.stderr, flush=True)
        waiter.cancel()
        await task

    try:
        with asyncio.Runner(loop_factory=loop_factory(event_loop)) as runner:
            runner.run(main())
    except ConfigError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def run_envoy_config(args: argparse.Namespace) -> int:
    try:
        datastore = Datastore()
        config = asyncio.run(FileResourceSource(args.paths, datastore).start())
        text = render(build_bootstrap(bootstrap_params(config, datastore.snapshot())))
    except (ConfigError, ValueError) as exc:
        print(f"error: {getattr(exc, 'message', exc)}", file=sys.stderr)
        return 2
    if args.output is not None:
        args.output.write_text(text)
    else:
        sys.stdout.write(text)
    return 0
