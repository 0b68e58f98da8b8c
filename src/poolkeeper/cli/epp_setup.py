"""What `poolkeeper epp`'s flags mean (`epp.py` runs it): the GatewayConfig (the
EndpointPickerConfig translated, upstream's request-handling defaults, the listeners), ext_proc's
TLS, the runtime's options (readiness, drain, `/metrics` auth) and the Kubernetes source (the one
named pool, or standalone Pods).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from poolkeeper.api.fielderrors import from_pydantic
from poolkeeper.cli.epp_options import EppOptions, effective_refresh_interval, standalone_pool_name
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


def epp_tls(options: EppOptions) -> TlsSettings:
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
        tls=epp_tls(options),
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


def epp_kubernetes_source(options: EppOptions, config: GatewayConfig) -> Any:
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
