"""What resolving reads and produces: the document's shape, typed by protocols (so resolving
needs nothing from the config schema above it), the build plan, and the error listing every
problem, and that list read back from a failed validation (`resolve.py` does the resolving).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import ValidationError

from poolkeeper.errors import ConfigError
from poolkeeper.scheduling.interfaces import TypedName
from poolkeeper.scheduling.registry import PluginParams, PluginSpec


class PluginEntry(Protocol):
    """One entry of `plugins` (config.PluginInstanceConfig)."""

    @property
    def type(self) -> str: ...
    @property
    def instance_name(self) -> str: ...
    @property
    def parameters(self) -> Mapping[str, Any]: ...


class ProfileRef(Protocol):
    """One plugin of a profile (config.ProfilePluginRef)."""

    @property
    def plugin_ref(self) -> str: ...
    @property
    def weight(self) -> float | None: ...


class ProfileEntry(Protocol):
    """One entry of `schedulingProfiles` (config.SchedulingProfileConfig)."""

    @property
    def name(self) -> str: ...
    @property
    def plugins(self) -> Sequence[ProfileRef]: ...


class SchedulingDocument(Protocol):
    """A plugins/profiles document (config.SchedulingConfig without its preset)."""

    @property
    def plugins(self) -> Sequence[PluginEntry]: ...
    @property
    def scheduling_profiles(self) -> Sequence[ProfileEntry]: ...
    @property
    def profile_handler(self) -> str | None: ...


class InvalidSchedulingConfig(ConfigError, ValueError):
    """Every problem of a scheduling document, each as `path: message`.

    A ValueError too, so that pydantic reports it when the config validator raises it.
    """

    def __init__(self, problems: Sequence[str]) -> None:
        super().__init__("invalid scheduling config:\n  " + "\n  ".join(problems))
        self.problems = list(problems)


@dataclass(frozen=True, slots=True)
class ResolvedPlugin:
    typed_name: TypedName
    # Not compared: registries build their specs afresh, so equal plans from two registries
    # would otherwise differ (the type name is in `typed_name`).
    spec: PluginSpec = field(compare=False)
    params: PluginParams


@dataclass(frozen=True, slots=True)
class ResolvedProfile:
    name: str
    filters: tuple[str, ...]
    scorers: tuple[tuple[str, float], ...]
    picker: str


@dataclass(frozen=True, slots=True)
class ResolvedScheduling:
    """Plugin instances by name (implicit defaults included) and the profiles using them."""

    plugins: dict[str, ResolvedPlugin]
    profiles: tuple[ResolvedProfile, ...]
    handler: str
    source: str = field(default="config")  # "config" or "preset <name>"


def problems_of(exc: ValidationError) -> list[str]:
    """The problems of a failed SchedulingConfig validation, as `resolve` reports them."""
    out: list[str] = []
    for err in exc.errors():
        cause = err.get("ctx", {}).get("error")
        if isinstance(cause, InvalidSchedulingConfig):
            out.extend(cause.problems)
        else:
            out.append(f"{loc_path(err['loc']).lstrip('.')}: {err['msg']}")
    return out


def loc_path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out
