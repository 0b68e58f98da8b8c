"""Every flag of llm-d-router's EPP (v0.10) and its older spellings: the table the parser reads.

`FLAGS` (name, pflag kind, upstream's default, help, allowed values; `BY_NAME`), GIE v0.3-v0.5's
camelCase names of flags that still exist (`CAMEL_CASE`), flags upstream removed and what
replaced them (`REMOVED`, `REMOVED_WHERE`: accepted with a warning), and the five deprecated
metric flags (`DEPRECATED_METRIC_FLAGS`: refused when set). Parsing: `cli/epp_flags.py`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Final


class Kind(StrEnum):
    BOOL = "bool"
    INT = "int"
    PORT = "uint16"
    STRING = "string"
    DURATION = "duration"
    INTS = "intSlice"
    STRINGS = "stringSlice"


@dataclass(frozen=True, slots=True)
class Flag:
    name: str
    kind: Kind
    default: object
    help: str
    choices: tuple[str, ...] = ()


_F = Flag
B, N, P, S, D = Kind.BOOL, Kind.INT, Kind.PORT, Kind.STRING, Kind.DURATION

# Every flag of the llm-d.ai EPP at v0.10 (reference/llm-d-router.md §1.1), with upstream's
# defaults, plus the few added on main after the tag (feature-gates, ...), so a chart built
# from main is not refused either.
FLAGS: Final[tuple[Flag, ...]] = (
    _F("pool-name", S, "", "InferencePool name (exactly one of this and --endpoint-selector)"),
    _F("pool-namespace", S, "", "InferencePool namespace (default: $NAMESPACE, else default)"),
    _F("pool-group", S, "inference.networking.k8s.io", "InferencePool API group"),
    _F("endpoint-selector", S, "", "standalone mode: a label selector for model-server Pods"),
    _F("endpoint-target-ports", Kind.INTS, (), "standalone mode: model-server ports (1-8)"),
    _F("grpc-port", P, 9002, "ext_proc gRPC port"),
    _F("grpc-health-port", P, 9003, "gRPC health port"),
    _F("metrics-port", P, 9090, "Prometheus metrics port"),
    _F("grpc-max-recv-msg-size", S, "", "largest gRPC message received (e.g. 10MiB)"),
    _F("grpc-max-send-msg-size", S, "", "largest gRPC message sent (e.g. 10MiB)"),
    _F("ha-enable-leader-election", B, False, "leader election; readiness only on the leader"),
    _F("drain-timeout", D, 30.0, "on SIGTERM, keep serving ext_proc this long"),
    _F("disable-endpoint-subset-filter", B, False, "ignore the proxy's endpoint subset hint"),
    _F("emit-endpoint-scores", B, False, "add per-endpoint scores to envoy.lb metadata"),
    _F("refresh-metrics-interval", D, 0.05, "model-server scrape tick (at least 50ms)"),
    _F("refresh-prometheus-metrics-interval", D, 5.0, "pool gauge flush period"),
    _F("metrics-staleness-threshold", D, 2.0, "endpoint metrics older than this are stale"),
    _F("plugin-state-staleness-threshold", D, 600.0, "per-request plugin state reaped after"),
    _F("total-queued-requests-metric", S, "vllm:num_requests_waiting", "deprecated"),
    _F("total-running-requests-metric", S, "vllm:num_requests_running", "deprecated"),
    _F("kv-cache-usage-percentage-metric", S, "vllm:kv_cache_usage_perc", "deprecated"),
    _F("lora-info-metric", S, "vllm:lora_requests_info", "deprecated"),
    _F("cache-info-metric", S, "vllm:cache_config_info", "deprecated"),
    _F("tracing", B, True, "OpenTelemetry tracing"),
    _F("health-checking", B, False, "also serve gRPC health on the ext_proc port"),
    _F("enable-pprof", B, True, "pprof handlers on the metrics port"),
    _F("secure-serving", B, True, "ext_proc over TLS (self-signed without --cert-path)"),
    _F("cert-path", S, "", "directory holding tls.crt and tls.key"),
    _F("enable-cert-reload", B, False, "reload --cert-path when its files change"),
    _F("client-ca-file", S, "", "poolkeeper: require ext_proc client certs from this CA"),
    _F("tls-min-version", S, "", "VersionTLS10 ... VersionTLS13",
       ("", "VersionTLS10", "VersionTLS11", "VersionTLS12", "VersionTLS13")),
    _F("tls-cipher-suites", Kind.STRINGS, (), "TLS <= 1.2 cipher suites (Go names)"),
    _F("metrics-endpoint-auth", B, True, "TokenReview + SubjectAccessReview on /metrics"),
    _F("metrics-cert-dir", S, "", "serve metrics over TLS from this directory"),
    _F("metrics-client-ca-file", S, "", "require verified client certificates on /metrics"),
    _F("enable-grpc-stream-metrics", B, False, "extproc_* stream metrics"),
    _F("fairness-id-metric-label-limit", N, 1000, "distinct fairness_id label values kept"),
    _F("config-file", S, "", "EndpointPickerConfig file"),
    _F("config-text", S, "", "EndpointPickerConfig text"),
    _F("feature-gates", Kind.STRINGS, (), "feature gates over the config's (name=true|false)"),
    _F("allow-experimental-plugins", B, False, "allow Alpha plugins"),
    _F("v", N, 2, "log verbosity (2 default, 3 verbose, 4 debug, 5 trace)"),
    _F("zap-devel", B, True, "development logging defaults"),
    _F("zap-encoder", S, "", "json or console", ("", "json", "console")),
    _F("zap-log-level", S, "", "debug, info, error, panic or an integer"),
    _F("zap-stacktrace-level", S, "", "info, error or panic", ("", "info", "error", "panic")),
    _F("zap-time-encoding", S, "", "epoch, millis, nano, iso8601, rfc3339, rfc3339nano",
       ("", "epoch", "millis", "nano", "iso8601", "rfc3339", "rfc3339nano")),
)  # fmt: skip

BY_NAME: Final[Mapping[str, Flag]] = MappingProxyType({f.name: f for f in FLAGS})

DEPRECATED_METRIC_FLAGS: Final = (
    "total-queued-requests-metric",
    "total-running-requests-metric",
    "kv-cache-usage-percentage-metric",
    "lora-info-metric",
    "cache-info-metric",
)

# GIE v0.3-v0.5 camelCase names of flags that still exist, under their current name.
CAMEL_CASE: Final[Mapping[str, str]] = MappingProxyType(
    {
        "poolName": "pool-name",
        "poolNamespace": "pool-namespace",
        "grpcPort": "grpc-port",
        "grpcHealthPort": "grpc-health-port",
        "metricsPort": "metrics-port",
        "enablePprof": "enable-pprof",
        "refreshMetricsInterval": "refresh-metrics-interval",
        "refreshPrometheusMetricsInterval": "refresh-prometheus-metrics-interval",
        "secureServing": "secure-serving",
        "healthChecking": "health-checking",
        "certPath": "cert-path",
        "totalQueuedRequestsMetric": "total-queued-requests-metric",
        "kvCacheUsagePercentageMetric": "kv-cache-usage-percentage-metric",
        "loraInfoMetric": "lora-info-metric",
        "configFile": "config-file",
        "configText": "config-text",
    }
)

# Flags upstream removed: accepted and ignored with a warning (name -> takes a value).
REMOVED: Final[Mapping[str, Kind]] = MappingProxyType(
    {
        "model-server-metrics-scheme": S,
        "model-server-metrics-path": S,
        "model-server-metrics-port": N,
        "model-server-metrics-https-insecure-skip-verify": B,
        "grpc-enable-compression": B,
        "modelServerMetricsPort": N,
        "modelServerMetricsPath": S,
        "modelServerMetricsScheme": S,
        "modelServerMetricsHttpsInsecureSkipVerify": B,
        "destinationEndpointHintKey": S,
        "DestinationEndpointHintMetadataNamespace": S,
    }
)
REMOVED_WHERE = (
    "the metrics-data-source plugin's parameters in the EndpointPickerConfig",
    "nothing (removed upstream)",
)
