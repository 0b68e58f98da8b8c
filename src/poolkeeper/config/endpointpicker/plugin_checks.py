"""The feature gates and the `plugins` list of an EndpointPickerConfig, checked.

`gates_of` reads `featureGates` and `--feature-gates` against the gates upstream registers
(`FEATURE_GATES`, with their defaults; removed ones are a notice); `check_plugins` finds each
instance's upstream entry (or poolkeeper's own plugin type), refuses what poolkeeper does not
implement and Alpha types without `--allow-experimental-plugins`, and validates parameters.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from pydantic import ValidationError

from poolkeeper.api.fielderrors import from_pydantic
from poolkeeper.config.endpointpicker.catalogue import UPSTREAM_PLUGINS, Use, missing_message
from poolkeeper.config.endpointpicker.document import EndpointPickerConfig
from poolkeeper.config.endpointpicker.translation_work import TranslationWork
from poolkeeper.scheduling.plugins.builtins import builtin_registry

FEATURE_GATES: Mapping[str, bool] = {"flowControl": False, "haPopulateNonLeaderDatastore": True}
REMOVED_GATES = ("dataLayer", "enableLegacyMetrics")


def gates_of(
    config: EndpointPickerConfig, extra: Iterable[str], work: TranslationWork
) -> dict[str, bool]:
    gates = dict(FEATURE_GATES)
    for where, entries in (("featureGates", config.feature_gates), ("--feature-gates", extra)):
        for i, entry in enumerate(entries):
            name, sep, value = entry.partition("=")
            name = name.strip()
            if name in REMOVED_GATES:
                work.notices.append(f"{where}[{i}]: feature gate {name!r} was removed; ignored")
                continue
            if name not in FEATURE_GATES:
                work.problems.append(
                    f"{where}[{i}]: unknown or unregistered feature gate {name!r} "
                    f"(known: {', '.join(FEATURE_GATES)})"
                )
                continue
            if sep and value.strip().lower() not in ("true", "false"):
                work.problems.append(f"{where}[{i}]: {entry!r}: the value must be true or false")
                continue
            gates[name] = not sep or value.strip().lower() == "true"
    return gates


def check_plugins(
    config: EndpointPickerConfig, allow_experimental: bool, work: TranslationWork
) -> None:
    registry = builtin_registry()
    for i, plugin in enumerate(config.plugins):
        where = f"plugins[{i}]"
        name = plugin.instance_name
        if name in work.raw:
            work.problems.append(f"{where}.name: duplicate plugin name {name!r}")
            continue
        work.raw[name] = plugin
        upstream = UPSTREAM_PLUGINS.get(plugin.type)
        if upstream is None:
            if plugin.type in registry:  # one of poolkeeper's own: its own parameters
                work.specs[name] = None
                continue
            work.problems.append(f'{where}.type: unknown plugin type "{plugin.type}"')
            continue
        work.specs[name] = upstream
        if upstream.use is Use.MISSING:
            work.problems.append(f"{where}.type: {missing_message(upstream)}")
            continue
        if upstream.alpha and not allow_experimental:
            work.problems.append(
                f'{where}.type: "{plugin.type}" is Alpha; it needs --allow-experimental-plugins'
            )
        try:
            work.params[name] = upstream.params.model_validate(plugin.parameters or {})
        except ValidationError as exc:
            for err in from_pydantic(exc):
                work.problems.append(f"{where}.parameters.{err.path}: {err.message}".rstrip("."))
            continue
        if upstream.use is Use.ACCEPTED:
            note = f" ({upstream.note})" if upstream.note else ""
            work.notices.append(f'{where}: "{plugin.type}" accepted, no effect{note}')
