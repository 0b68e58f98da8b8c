"""The EPP's parsed command line (`EppOptions`), checked as upstream checks it.

`validate_options` is upstream's `Options.Complete` and `Validate`, in its order and words;
`FlagError` is what the EPP refuses (pflag's parse errors too); `standalone_pool_name` and
`effective_refresh_interval` read the options as upstream does. Parsing: `cli/epp_flags.py`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from poolkeeper.cli.epp_flag_table import DEPRECATED_METRIC_FLAGS
from poolkeeper.config.endpointpicker.values import parse_label_selector, parse_size


class FlagError(ValueError):
    """A command line the EPP refuses (pflag's parse errors and `Options.Validate`)."""


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
