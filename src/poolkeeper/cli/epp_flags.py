"""The command line of llm-d-router's EPP (v0.10), parsed the way its Go binary parses it.

Upstream parses with spf13/pflag, so this module follows pflag's rules, not argparse's:

- `--name=value` and `--name value`; a boolean takes `--name` or `--name=false`, and
  `--name value` does not consume the next argument (but see the GIE chart form below);
- an unknown flag is fatal; a flag given twice keeps the last value (an int list appends);
- `-v N`, `-v=N`, `-vN` (the one shorthand); `--` ends the flags; other arguments are ignored.

Older generations are tolerated because charts in the field still render them:

- GIE v0.3-v0.5 flags in camelCase with one or two dashes (`-poolName x`, `--grpcPort=9002`);
- the old `epplib` chart's `--key "value"` pairs, booleans included (`--secure-serving "false"`
  would silently leave pflag's value at true and drop "false"; here it means what it says,
  with a warning), and values wrapped in literal quotes (`--x="a:b"` as one argument);
- flags upstream removed (`--model-server-metrics-*`, `--grpc-enable-compression`, GIE's
  `-destinationEndpointHintKey`...): accepted with a warning, no effect.

The five deprecated metric flags are rejected when set, with upstream's message. `parse_epp_args`
returns `EppOptions` (every value, which flags were given, warnings) or raises `FlagError`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Final

from poolkeeper.config.endpointpicker.values import (
    parse_bool,
    parse_duration,
    parse_int,
    parse_int_list,
    parse_label_selector,
    parse_size,
)


class FlagError(ValueError):
    """A command line the EPP refuses (pflag's parse errors and `Options.Validate`)."""


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
_REMOVED_WHERE = (
    "the metrics-data-source plugin's parameters in the EndpointPickerConfig",
    "nothing (removed upstream)",
)

POOL_GROUPS: Final = ("inference.networking.k8s.io", "inference.networking.x-k8s.io")
_ZAP_LEVEL = re.compile(r"^(debug|info|error|panic|-?[0-9]+)$")
# Upstream derives the standalone pool's name (its Deployment) from the pod name.
_DEPLOYMENT_OF_POD = re.compile(r"^(.+)-[a-z0-9]+-[a-z0-9]+$")


@dataclass(frozen=True, slots=True)
class EppOptions:
    """The parsed command line: every flag's value (defaults filled) and which were given."""

    values: Mapping[str, object]
    given: frozenset[str]
    warnings: tuple[str, ...] = ()
    ignored_args: tuple[str, ...] = ()

    def text(self, name: str) -> str:
        value = self.values[name]
        assert isinstance(value, str)
        return value

    def number(self, name: str) -> int:
        value = self.values[name]
        assert isinstance(value, int)
        assert not isinstance(value, bool)
        return value

    def flag(self, name: str) -> bool:
        value = self.values[name]
        assert isinstance(value, bool)
        return value

    def seconds(self, name: str) -> float:
        value = self.values[name]
        assert isinstance(value, float)
        return value

    def ints(self, name: str) -> tuple[int, ...]:
        value = self.values[name]
        assert isinstance(value, tuple)
        return value

    def texts(self, name: str) -> tuple[str, ...]:
        value = self.values[name]
        assert isinstance(value, tuple)
        return value

    @property
    def pool_namespace(self) -> str:
        """The flag, then $NAMESPACE, then `default` (upstream's order)."""
        return self.text("pool-namespace") or os.environ.get("NAMESPACE") or "default"

    @property
    def standalone(self) -> bool:
        return bool(self.text("endpoint-selector"))


def _unquote(value: str) -> str:
    """`"x"` -> `x`: the old chart rendered literal quotes into some values."""
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
        return value[1:-1]
    return value


@dataclass(slots=True)
class _Parse:
    values: dict[str, object] = field(default_factory=lambda: {f.name: f.default for f in FLAGS})
    given: set[str] = field(default_factory=set)
    warnings: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)

    def set(self, flag: Flag, raw: str, shown: str) -> None:
        value = _unquote(raw)
        try:
            converted = _convert(flag, value)
        except ValueError as exc:
            raise FlagError(f'invalid argument "{value}" for "{shown}" flag: {exc}') from None
        if flag.kind is Kind.INTS and flag.name in self.given:
            previous = self.values[flag.name]
            assert isinstance(previous, tuple)
            assert isinstance(converted, tuple)
            converted = previous + converted
        self.values[flag.name] = converted
        self.given.add(flag.name)


def _convert(flag: Flag, value: str) -> object:
    if flag.kind is Kind.BOOL:
        return parse_bool(value)
    if flag.kind is Kind.INT:
        return parse_int(value)
    if flag.kind is Kind.PORT:
        number = parse_int(value)
        if not 0 <= number <= 65535:
            raise ValueError("value out of range")
        return number
    if flag.kind is Kind.DURATION:
        return parse_duration(value)
    if flag.kind is Kind.INTS:
        return parse_int_list(value)
    if flag.kind is Kind.STRINGS:
        return tuple(part.strip() for part in value.split(",") if part.strip())
    if flag.choices and value not in flag.choices:
        allowed = ", ".join(c for c in flag.choices if c)
        raise ValueError(f"must be one of {allowed}")
    return value


def _lookup(name: str, dashes: str) -> tuple[Flag | None, Kind | None]:
    """(flag, None) for a current flag; (None, kind) for a removed one; (None, None) unknown."""
    if name in BY_NAME and (dashes == "--" or name == "v" or "-" in name):
        return BY_NAME[name], None
    if name in CAMEL_CASE:
        return BY_NAME[CAMEL_CASE[name]], None
    if name in REMOVED:
        return None, REMOVED[name]
    if dashes == "-" and name in BY_NAME:  # Go's flag package: -name works like --name
        return BY_NAME[name], None
    return None, None


def parse_epp_args(argv: Sequence[str]) -> EppOptions:
    """Parse and validate an EPP command line (raises FlagError with upstream's wording)."""
    state = _Parse()
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg == "--":
            state.ignored.extend(args[i:])
            break
        if not arg.startswith("-") or arg == "-":
            state.ignored.append(arg)
            continue
        dashes = "--" if arg.startswith("--") else "-"
        body = arg[len(dashes) :]
        name, has_value, raw = body.partition("=")
        if dashes == "-" and name.startswith("v") and name[1:].isdigit():  # -v3
            name, has_value, raw = "v", "=", name[1:]
        flag, removed = _lookup(name, dashes)
        if flag is None and removed is None:
            if dashes == "-" and len(name) > 1 and name not in CAMEL_CASE:
                raise FlagError(f"unknown shorthand flag: {name[0]!r} in {arg}")
            raise FlagError(f"unknown flag: {dashes}{name}")
        kind = flag.kind if flag is not None else removed
        assert kind is not None
        shown = f"{dashes}{name}"
        if not has_value:
            nxt = args[i] if i < len(args) else None
            if kind is Kind.BOOL:
                raw = "true"
                if nxt is not None and _unquote(nxt).lower() in ("true", "false"):
                    # The old chart's `--flag "false"`: pflag would drop the value.
                    raw = _unquote(nxt)
                    i += 1
                    state.warnings.append(
                        f'{shown} "{raw}": read as {shown}={raw} (pflag would ignore the '
                        "value; write it as one argument)"
                    )
            elif nxt is None:
                raise FlagError(f"flag needs an argument: {shown}")
            else:
                raw = nxt
                i += 1
        if flag is None:
            place = _REMOVED_WHERE[0] if "etrics" in name else _REMOVED_WHERE[1]
            state.warnings.append(f"{shown} was removed upstream and is ignored; use {place}")
            continue
        if name != flag.name:
            state.warnings.append(f"{shown} is the GIE v0.x spelling of --{flag.name}")
        state.set(flag, raw, shown)
    options = EppOptions(
        values=MappingProxyType(dict(state.values)),
        given=frozenset(state.given),
        warnings=tuple(state.warnings),
        ignored_args=tuple(state.ignored),
    )
    validate_options(options)
    return options


def validate_options(options: EppOptions) -> None:
    """Upstream's `Options.Complete` and `Validate`, in its order and words."""
    selector = options.text("endpoint-selector")
    if bool(options.text("pool-name")) == bool(selector):
        raise FlagError("either pool-name or endpoint-selector must be set")
    if selector:
        try:
            parse_label_selector(selector)
        except ValueError as exc:
            raise FlagError(f'invalid endpoint-selector "{selector}": {exc}') from None
        ports = list(dict.fromkeys(options.ints("endpoint-target-ports")))
        if not 1 <= len(ports) <= 8:
            raise FlagError('flag "endpoint-target-ports" should have length from 1 to 8')
        for port in ports:
            if not 0 <= port <= 65535:
                raise FlagError(f'invalid port number {port} in "endpoint-target-ports"')
        if not os.environ.get("POD_NAME"):
            raise FlagError("--endpoint-selector needs the POD_NAME environment variable")
    for name in ("grpc-max-recv-msg-size", "grpc-max-send-msg-size"):
        if options.text(name):
            try:
                size = parse_size(options.text(name))
            except ValueError as exc:
                raise FlagError(f"invalid {name}: {exc}") from None
            if size < 0:
                raise FlagError(f"{name} must be non-negative, got {size}")
    if options.text("config-text") and options.text("config-file"):
        raise FlagError(
            'both the "config-file" and "config-text" flags cannot be set at the same time'
        )
    if options.text("metrics-client-ca-file") and not options.text("metrics-cert-dir"):
        raise FlagError('"metrics-client-ca-file" requires "metrics-cert-dir"')
    if (
        options.text("metrics-cert-dir")
        and not options.text("metrics-client-ca-file")
        and not options.flag("metrics-endpoint-auth")
    ):
        raise FlagError(
            '"metrics-cert-dir" enables metrics TLS without authentication; set '
            '"metrics-client-ca-file" or "metrics-endpoint-auth"'
        )
    for name in ("refresh-prometheus-metrics-interval", "plugin-state-staleness-threshold"):
        if options.seconds(name) <= 0:
            raise FlagError(f"{name} must be positive")
    if options.seconds("metrics-staleness-threshold") <= 0:
        raise FlagError("metrics-staleness-threshold must be positive")
    if options.number("fairness-id-metric-label-limit") < 0:
        raise FlagError("fairness-id-metric-label-limit must be non-negative")
    for name in DEPRECATED_METRIC_FLAGS:
        if name in options.given:
            raise FlagError(
                f'flag "{name}" is deprecated and cannot be used; configure metrics via '
                "engineConfigs in EndpointPickerConfig instead"
            )
    group = options.text("pool-group")
    if group not in POOL_GROUPS:
        raise FlagError(f'invalid pool-group "{group}": must be one of {", ".join(POOL_GROUPS)}')
    level = options.text("zap-log-level")
    if level and not _ZAP_LEVEL.match(level):
        raise FlagError(f'invalid argument "{level}" for "--zap-log-level" flag')


def standalone_pool_name(pod_name: str) -> str:
    """The pool a standalone EPP serves is named after its Deployment (from the pod name)."""
    match = _DEPLOYMENT_OF_POD.match(pod_name)
    return match.group(1) if match else pod_name


def effective_refresh_interval(options: EppOptions) -> tuple[float, str | None]:
    """`--refresh-metrics-interval`, clamped to 50 ms as upstream does (with its warning)."""
    value = options.seconds("refresh-metrics-interval")
    if value < 0.05:
        return 0.05, f"refresh-metrics-interval {value * 1000:g}ms is below 50ms; clamped"
    return value, None
