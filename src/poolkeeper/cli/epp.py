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
(docs/kubernetes.md lists them). What the flags mean (the GatewayConfig, TLS, the runtime's
options, the Kubernetes source): `cli/epp_setup.py`.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import Any

from poolkeeper.cli.epp_flag_table import DEPRECATED_METRIC_FLAGS
from poolkeeper.cli.epp_flags import parse_epp_args
from poolkeeper.cli.epp_options import EppOptions, FlagError
from poolkeeper.cli.epp_setup import (
    epp_gateway_config,
    epp_kubernetes_source,
    epp_serve_options,
    epp_tls,
)
from poolkeeper.errors import ConfigError

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
        epp_tls(options)  # a TLS flag that cannot be served: refused before anything starts
        source = epp_kubernetes_source(options, config)
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
