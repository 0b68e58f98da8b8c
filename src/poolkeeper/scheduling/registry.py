"""The plugin registry: plugin type name -> kind, parameter model and factory.

There is no global registry. `poolkeeper.scheduling.plugins.builtins.builtin_registry()` builds a
fresh one holding every built-in plugin (each registered in one place); callers may register
their own types on their instance before building a scheduler.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum

from poolkeeper.errors import ConfigError
from poolkeeper.scheduling.interfaces import Filter, Plugin, TypedName
from poolkeeper.schema import CamelModel


class PluginKind(StrEnum):
    FILTER = "filter"
    SCORER = "scorer"
    PICKER = "picker"
    PROFILE_HANDLER = "profile-handler"


class PluginParams(CamelModel):
    """Base of every plugin's `parameters` model: camelCase keys, unknown keys rejected."""


class NoParams(PluginParams):
    """A plugin without parameters."""


def _no_plugin(name: str) -> Plugin:
    raise ConfigError(f"no plugin named {name!r} can be referred to here")


@dataclass(frozen=True, slots=True)
class BuildContext:
    """What a factory may use: the shared seeded RNG, the gateway's freshness setting and other
    plugin instances by name."""

    rng: random.Random
    resolve_filter: Callable[[str], Filter]
    # Metrics older than this are stale (`spec.scraping.stalenessMs`, the one freshness setting;
    # the filters that skip stale endpoints read it here rather than having their own).
    staleness_s: float
    # Another plugin instance by name (a scorer reading a prefix index it does not own);
    # raises ConfigError for a name the configuration does not define.
    resolve_plugin: Callable[[str], Plugin] = field(default=_no_plugin)
    # The runtime's one clock (decisions' `now`): what a plugin stamps outside a decision
    # with (the KV-event subscriber's batches).
    clock: Callable[[], float] = time.monotonic


PluginFactory = Callable[[TypedName, PluginParams, BuildContext], Plugin]
# Plugin names a plugin's parameters refer to, each with its path inside `parameters`; the
# loader checks that each names a filter defined in `plugins` (decision trees use this).
FilterReferences = Callable[[PluginParams], list[tuple[str, str]]]


@dataclass(frozen=True, slots=True)
class PluginSpec:
    type_name: str
    kind: PluginKind
    params: type[PluginParams]
    factory: PluginFactory
    description: str
    aliases: tuple[str, ...] = ()
    filter_references: FilterReferences | None = None


class PluginRegistry:
    """Plugin types by name (aliases resolve to the same spec)."""

    def __init__(self) -> None:
        self._specs: dict[str, PluginSpec] = {}
        self._canonical: list[str] = []

    def register(self, spec: PluginSpec) -> None:
        for name in (spec.type_name, *spec.aliases):
            if name in self._specs:
                raise ValueError(f"plugin type {name!r} is already registered")
        for name in (spec.type_name, *spec.aliases):
            self._specs[name] = spec
        self._canonical.append(spec.type_name)

    def get(self, type_name: str) -> PluginSpec | None:
        return self._specs.get(type_name)

    def __contains__(self, type_name: object) -> bool:
        return type_name in self._specs

    def __iter__(self) -> Iterator[PluginSpec]:
        return (self._specs[name] for name in self._canonical)

    def type_names(self) -> list[str]:
        """Every accepted type name, aliases included, sorted."""
        return sorted(self._specs)
