"""`poolkeeper epp ARGS...` and the `poolkeeper-epp` console script: a drop-in for the EPP of
llm-d-router v0.10, for images whose ENTRYPOINT the upstream chart runs with its own arguments.

    poolkeeper-epp --pool-name qwen --pool-namespace llm --config-file /config/default-plugins.yaml

The arguments are upstream's (cli/epp_flags.py); they map onto Kubernetes mode (`serve
--kubernetes` for the one named pool, no Envoy, status never written: the chart's RBAC is
read-only), the EndpointPickerConfig (or upstream's default one) onto the scheduling,
scraping, admission and flow-control settings (config/endpointpicker/), and upstream's
request-handling defaults apply: one endpoint in the destination header, any model name passed
through at priority 0, the objective / rewrite / fairness headers read. As upstream's EPP, it
reads only `--pool-group`'s InferencePools (or, with `--endpoint-selector`, only Pods: the
standalone mode), serves ext_proc over TLS, guards `/metrics` with TokenReview and
SubjectAccessReview, and answers gRPC health leader-aware under `--ha-enable-leader-election`.
Flags poolkeeper cannot honour yet are accepted and named in one startup notice
(docs/kubernetes.md lists them).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from poolkeeper.api.fielderrors import from_pydantic
from poolkeeper.cli.epp_flag_table import DEPRECATED_METRIC_FLAGS
from poolkeeper.cli.epp_flags import parse_epp_args
from poolkeeper.cli.epp_options import (
    EppOptions,
    FlagError,
    effective_refresh_interval,
    standalone_pool_name,
)
from poolkeeper.config.endpointpicker import (
    DEFAULT_CONFIG_TEXT,
    load_endpoint_picker_config,
    translate,
)
from poolkeeper.config.endpointpicker.replicasync import key_context
from poolkeeper.config.endpointpicker.values import parse_label_selector
from poolkeeper.config.gateway import GatewayConfig, TrustedHeader
from poolkeeper.errors import ConfigError
from poolkeeper.extproc.tls import TlsSettings
from poolkeeper.extproc.tls_certs import TlsError

log = logging.getLogger("poolkeeper.epp")

# Flags accepted but not (yet) honoured, with what happens instead. Those whose upstream
# default asks for something poolkeeper lacks are named even when not given.
UNHONOURED: dict[str, str] = {
    "metrics-cert-dir": "/metrics is served over plain HTTP",
    "metrics-client-ca-file": "/metrics is served over plain HTTP",
    "tracing": "no OpenTelemetry tracing",
    "enable-pprof": "no pprof (a Python process)",
    "emit-endpoint-scores": "scores are not written to envoy.lb metadata",
    "enable-grpc-stream-metrics": "no extproc_* stream metrics",
    "grpc-max-recv-msg-size": "gRPC message sizes keep poolkeeper's limits",
    "grpc-max-send-msg-size": "gRPC message sizes keep poolkeeper's limits",
    "refresh-prometheus-metrics-interval": "pool gauges are computed at each scrape of /metrics",
    "metrics-staleness-threshold": "staleness is the detector's metricsStalenessThreshold",
    "plugin-state-staleness-threshold": "in-flight state ends with each request",
    "zap-devel": "log format follows --zap-encoder",
    "zap-stacktrace-level": "log format follows --zap-encoder",
    "zap-time-encoding": "log format follows --zap-encoder",
}
_DEFAULT_ON = ("tracing", "enable-pprof")


def unhonoured(options: EppOptions) -> list[str]:
    """`--flag: what happens instead` for each flag asking for what poolkeeper lacks."""
    out = []
    for name, instead in UNHONOURED.items():
        value = options.values[name]
        asked = name in options.given and value not in (False, "", (), None)
        if name in _DEFAULT_ON:
            asked = value is True
        if asked:
            out.append(f"--{name}: {instead}")
    return out


def _config_text(options: EppOptions) -> tuple[str, str]:
    """(text, where) of the EndpointPickerConfig: --config-text, --config-file or the default."""
    if options.text("config-text"):
        return options.text("config-text"), "--config-text"
    path = options.text("config-file")
    if not path:
        return DEFAULT_CONFIG_TEXT, "upstream's default configuration"
    try:
        return Path(path).read_text(), path
    except OSError as exc:
        raise ConfigError(f"--config-file: cannot read {path}: {exc.strerror or exc}") from None


def epp_gateway_config(options: EppOptions) -> tuple[GatewayConfig, list[str]]:
    """The GatewayConfig the command line means, and the notices for the startup log."""
    text, where = _config_text(options)
    translation = translate(
        load_endpoint_picker_config(text, where),
        feature_gates=options.texts("feature-gates"),
        allow_experimental=options.flag("allow-experimental-plugins"),
    )
    notices = list(translation.notices)
    spec: dict[str, Any] = {key: dict(value) for key, value in translation.sections.items()}
    spec["listeners"] = {
        "address": "0.0.0.0",
        "extProc": options.number("grpc-port"),
        "health": options.number("grpc-health-port"),
        "metrics": options.number("metrics-port"),
    }
    if "refresh-metrics-interval" in options.given and "intervalMs" not in spec["scraping"]:
        interval, warning = effective_refresh_interval(options)
        spec["scraping"]["intervalMs"] = round(interval * 1000)
        notices.extend([warning] if warning else [])
    spec["requestHandling"] = spec.get("requestHandling", {}) | {
        # Upstream's defaults: one endpoint (gateways routing by the header alone need it),
        # any model at priority 0, the control headers read.
        "fallbackEndpoints": 0,
        "unknownModelPolicy": "Passthrough",
        "trustedHeaders": [header.value for header in TrustedHeader],
        "honorSubsetHint": not options.flag("disable-endpoint-subset-filter"),
    }
    try:
        config = GatewayConfig.model_validate(
            {"spec": spec}, context=key_context(translation.key_file_at, where)
        )
    except ValidationError as exc:
        lines = [f"{e.path}: {e.message}" for e in from_pydantic(exc)]
        raise ConfigError("the EPP settings are invalid:\n  " + "\n  ".join(lines)) from None
    if translation.key_file_at is not None:
        # Read before the EPP starts (named by the plugin parameter: `key_field`).
        from poolkeeper.server.sync_keys import check_key

        check_key(config.spec.replica_sync)
    return config, notices


def _tls(options: EppOptions) -> TlsSettings:
    """ext_proc's TLS as upstream's flags say (on by default: self-signed, ALPN h2), plus
    poolkeeper's `--client-ca-file` (mutual TLS); ConfigError for what cannot be served."""
    cert_path, client_ca = options.text("cert-path"), options.text("client-ca-file")
    settings = TlsSettings(
        secure_serving=options.flag("secure-serving"),
        cert_path=Path(cert_path) if cert_path else None,
        enable_cert_reload=options.flag("enable-cert-reload"),
        tls_min_version=options.text("tls-min-version"),
        tls_cipher_suites=options.texts("tls-cipher-suites"),
        client_ca_file=Path(client_ca) if client_ca else None,
    )
    try:
        settings.check()
    except TlsError as exc:
        raise ConfigError(str(exc)) from None
    return settings


def _json_logs(options: EppOptions) -> bool:
    """zap's encoder: json unless `--zap-encoder console` (or `--zap-devel` without one)."""
    encoder = options.text("zap-encoder") or ("console" if options.flag("zap-devel") else "json")
    return encoder == "json"


def _log_level(options: EppOptions) -> str:
    level = options.text("zap-log-level")
    if level in ("debug", "info", "error"):
        return level
    if level == "panic":
        return "critical"
    verbosity = int(level) if level.lstrip("-").isdigit() else options.number("v")
    return "debug" if verbosity >= 4 else "info"


def main(argv: Sequence[str] | None = None) -> int:
    """The `poolkeeper-epp` console script (also `poolkeeper epp ...`)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        _print_help()
        return 0
    try:
        options = parse_epp_args(args)
    except FlagError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 2
    from poolkeeper.cli.serve import run_gateway
    from poolkeeper.telemetry.logs import configure_logging

    logs = configure_logging(_log_level(options), json_lines=_json_logs(options), queued=True)
    try:
        return _run(options, run_gateway)
    finally:
        if logs is not None:
            logs.close()


def _run(options: EppOptions, run_gateway: Any) -> int:
    shown = {k: v for k, v in options.values.items() if k not in DEPRECATED_METRIC_FLAGS}
    log.info("Flags processed: %s", shown)
    for warning in options.warnings:
        log.warning("%s", warning)
    if options.ignored_args:
        log.warning("arguments ignored (not flags): %s", " ".join(options.ignored_args))
    try:
        config, notices = epp_gateway_config(options)
        _tls(options)  # a TLS flag that cannot be served: refused before anything starts
        source = _kubernetes_source(options, config)
    except ConfigError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 1
    for notice in notices:
        log.warning("%s", notice)
    missing = unhonoured(options)
    if missing:
        log.warning("accepted but not honoured by poolkeeper: %s", "; ".join(missing))
    serve = epp_serve_options(options, source)
    code: int = run_gateway(serve, "uvloop", json_logs=_json_logs(options))
    return code


def epp_serve_options(options: EppOptions, source: Any) -> Any:
    """The runtime's options (a ServeOptions) for the EPP's flags."""
    from poolkeeper.server.options import ServeOptions

    # Readiness and drain as upstream's EPP: ready once synced; on SIGTERM NOT_SERVING, the
    # Lease released, ext_proc serving for --drain-timeout, then the usual drain.
    return ServeOptions(
        source=source,
        run_envoy=False,
        ready_once_synced=True,
        drain_timeout_s=options.seconds("drain-timeout"),
        tls=_tls(options),
        metrics_middlewares=_metrics_auth(options),
        upstream_health=True,
        own_bootstrap=False,  # behind the cluster's Gateway: no client header limits of ours
        fairness_id_label_limit=options.number("fairness-id-metric-label-limit"),
    )


def _metrics_auth(options: EppOptions) -> tuple[Any, ...]:
    """`--metrics-endpoint-auth` (default true, as upstream): TokenReview + SubjectAccessReview
    for `GET /metrics`, asked of the API server with the EPP's own credentials."""
    if not options.flag("metrics-endpoint-auth"):
        return ()
    from poolkeeper.controller.kubernetes import KubeApi, load_config
    from poolkeeper.controller.kubernetes.metricsauth import MetricsAuth

    config = load_config(kubeconfig=None, context=None)
    namespace = options.pool_namespace
    return (MetricsAuth(lambda: KubeApi(config, namespace)).middleware,)


def _kubernetes_source(options: EppOptions, config: GatewayConfig) -> Any:
    from poolkeeper.controller.kubernetes import (
        KubeSettings,
        kubernetes_source,
        load_config,
    )
    from poolkeeper.controller.kubernetes.standalone import EndpointSelector

    namespace, name = options.pool_namespace, options.text("pool-name")
    standalone = None
    if options.standalone:  # validated already: POD_NAME is set, the selector parses
        name = standalone_pool_name(os.environ["POD_NAME"])
        standalone = EndpointSelector(
            pool_name=name,
            namespace=namespace,
            terms=tuple(parse_label_selector(options.text("endpoint-selector"))),
            target_ports=tuple(dict.fromkeys(options.ints("endpoint-target-ports"))),
        )
    settings = KubeSettings(
        namespace=namespace,
        identity=os.environ.get("POD_NAME") or socket.gethostname(),
        pool_names=(name,),
        write_status=False,  # upstream never writes status; the chart grants read only
        lease_name=f"epp-{namespace}-{name}.llm-d.ai",
        pool_group=options.text("pool-group"),  # as upstream: only what the chart grants
        leader_election=options.flag("ha-enable-leader-election"),
        standalone=standalone,
    )
    return kubernetes_source(settings, config, load_config(kubeconfig=None, context=None))


def _print_help() -> None:
    from poolkeeper.cli.epp_flag_table import FLAGS

    print("Usage of poolkeeper-epp (llm-d-router v0.10 EPP flags):")
    for flag in FLAGS:
        print(f"  --{flag.name} {flag.kind.value}\t{flag.help} (default {flag.default!r})")


def register(subparsers: Any) -> None:
    """`poolkeeper epp` in the help listing; main.py hands its arguments to `main` unparsed
    (argparse cannot parse pflag's syntax)."""
    subparsers.add_parser(
        "epp",
        help="run as a drop-in for llm-d-router's EPP (upstream's flags; see poolkeeper-epp -h)",
        add_help=False,
    )
