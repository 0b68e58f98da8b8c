"""The scheduling section of the gateway config (`spec.scheduling`): plugins and profiles.

Shape (camelCase, like GIE's EndpointPickerConfig):

    preset: default                 # or name a preset instead of listing plugins
    plugins:                        # plugin instances; name defaults to the type
      - {type: queue-scorer}
      - {type: prefix-cache-scorer, parameters: {blockSize: 64}}
    schedulingProfiles:
      - name: default
        plugins:
          - {pluginRef: queue-scorer, weight: 2}
          - {pluginRef: prefix-cache-scorer, weight: 3}
    profileHandler: single-profile-handler   # optional

Everything is checked when the model is validated, and every problem is reported with its path
(`schedulingProfiles[0].plugins[2].pluginRef: unknown plugin "x"`). An empty section means the
documented default profile (docs/scheduling.md). Validation uses the built-in plugin registry,
or the one passed as `model_validate(data, context={"registry": registry})`.

Validation is also where the section is resolved, once: the build plan is kept on the model
(`plan()`), and `build_scheduler` instantiates plugins from it. The validator is the one place
a preset name is looked up: the preset's document (presets.py, plain data) is validated into a
SchedulingConfig exactly like a user's.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pydantic import (
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    model_validator,
)

from poolkeeper.scheduling.plugins.builtins import builtin_registry
from poolkeeper.scheduling.presets import PRESETS, preset_document
from poolkeeper.scheduling.registry import PluginRegistry
from poolkeeper.scheduling.resolve import resolve
from poolkeeper.scheduling.resolved import InvalidSchedulingConfig, ResolvedScheduling, problems_of
from poolkeeper.schema import CamelModel


class PluginInstanceConfig(CamelModel):
    """One plugin instance."""

    type: str = Field(description="Registered plugin type, e.g. `queue-scorer`.")
    name: str | None = Field(
        default=None, description="Instance name that profiles refer to (default: the type)."
    )
    parameters: dict[str, Any] = Field(
        default_factory=dict, description="Type-specific parameters (see docs/scheduling.md)."
    )

    @property
    def instance_name(self) -> str:
        return self.name if self.name is not None else self.type


class ProfilePluginRef(CamelModel):
    """A plugin used by a profile."""

    plugin_ref: str = Field(description="Name of a plugin instance in `plugins`.")
    weight: float | None = Field(
        default=None,
        ge=0,
        description="Scorer weight, a plain multiplier of its [0, 1] score (default 1; only "
        "for scorers).",
    )


class SchedulingProfileConfig(CamelModel):
    """One profile: its filters run in order, then its weighted scorers, then its picker."""

    name: str = Field(min_length=1, description="Profile name (unique).")
    plugins: list[ProfilePluginRef] = Field(
        default_factory=list,
        description="Filters (in order), scorers and at most one picker (default "
        "max-score-picker).",
    )


class SchedulingConfig(CamelModel):
    """How the EPP picks an endpoint. Empty = the `default` preset."""

    preset: str | None = Field(
        default=None,
        description="Use a named preset (`default`, `gie-v1-default`, `gie-v0.3-decision-tree`, "
        "...) instead of listing plugins; exclusive with `plugins`/`schedulingProfiles`.",
    )
    plugins: list[PluginInstanceConfig] = Field(
        default_factory=list, description="Plugin instances (default: those of the preset)."
    )
    scheduling_profiles: list[SchedulingProfileConfig] = Field(
        default_factory=list,
        description="Profiles (default: one `default` profile using every filter, scorer and "
        "picker in `plugins`, scorers with weight 1).",
    )
    profile_handler: str | None = Field(
        default=None,
        description="Name of a profile-handler plugin instance (default: the one listed in "
        "`plugins`, else single-profile-handler).",
    )

    # The plan resolved by the validator, and the registry it was resolved against (None: the
    # built-in one). Private attributes are not fields: not dumped, not in the schema.
    _plan: ResolvedScheduling | None = PrivateAttr(default=None)
    _plan_registry: PluginRegistry | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _resolve(self, info: ValidationInfo) -> SchedulingConfig:
        registry = info.context.get("registry") if isinstance(info.context, dict) else None
        self._plan = _plan_of(self, registry)
        self._plan_registry = registry
        return self

    def plan(self, registry: PluginRegistry | None = None) -> ResolvedScheduling:
        """The build plan against `registry` (None: the built-in plugins).

        The plan made at validation when it used the same registry; resolved again only for
        another registry (raises InvalidSchedulingConfig, a ConfigError, listing every problem).
        `model_copy(update=...)` does not validate, so its copy keeps the original's plan:
        validate a changed document instead.
        """
        if self._plan is not None and self._plan_registry is registry:
            return self._plan
        return _plan_of(self, registry)


def preset_config(name: str) -> SchedulingConfig:
    """The SchedulingConfig of a preset's document; raises KeyError naming the known presets."""
    return SchedulingConfig.model_validate(preset_document(name))


def _plan_of(config: SchedulingConfig, registry: PluginRegistry | None) -> ResolvedScheduling:
    """Resolve `config`: its own document, or its preset's (an empty section is `default`)."""
    listed = bool(config.plugins or config.scheduling_profiles or config.profile_handler)
    if config.preset is None:
        if listed:
            return resolve(config, registry if registry is not None else builtin_registry())
        return _preset_plan("default", registry)
    if listed:
        raise InvalidSchedulingConfig(
            [
                "preset: a preset cannot be combined with plugins, schedulingProfiles or "
                "profileHandler"
            ]
        )
    return _preset_plan(config.preset, registry)


def _preset_plan(name: str, registry: PluginRegistry | None) -> ResolvedScheduling:
    if name not in PRESETS:
        raise InvalidSchedulingConfig(
            [f'preset: unknown preset "{name}" (known: {", ".join(sorted(PRESETS))})']
        )
    try:
        preset = SchedulingConfig.model_validate(PRESETS[name], context={"registry": registry})
    except ValidationError as exc:
        raise InvalidSchedulingConfig(problems_of(exc)) from None
    return replace(preset.plan(registry), source=f"preset {name}")
