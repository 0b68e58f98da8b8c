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
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, model_validator
from pydantic.alias_generators import to_camel


class _ConfigModel(BaseModel):
    model_config = ConfigDict(
        extra="forbid", alias_generator=to_camel, populate_by_name=True, frozen=True
    )


class PluginInstanceConfig(_ConfigModel):
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


class ProfilePluginRef(_ConfigModel):
    """A plugin used by a profile."""

    plugin_ref: str = Field(description="Name of a plugin instance in `plugins`.")
    weight: float | None = Field(
        default=None,
        ge=0,
        description="Scorer weight, a plain multiplier of its [0, 1] score (default 1; only "
        "for scorers).",
    )


class SchedulingProfileConfig(_ConfigModel):
    """One profile: its filters run in order, then its weighted scorers, then its picker."""

    name: str = Field(min_length=1, description="Profile name (unique).")
    plugins: list[ProfilePluginRef] = Field(
        default_factory=list,
        description="Filters (in order), scorers and at most one picker (default "
        "max-score-picker).",
    )


class SchedulingConfig(_ConfigModel):
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

    @model_validator(mode="after")
    def _check(self, info: ValidationInfo) -> SchedulingConfig:
        # Imported here: the resolver imports the plugin modules, which must not be needed
        # just to import the config schema.
        from poolkeeper.scheduling.resolve import check_scheduling_config

        registry = info.context.get("registry") if isinstance(info.context, dict) else None
        problems = check_scheduling_config(self, registry)
        if problems:
            raise ValueError("invalid scheduling config:\n  " + "\n  ".join(problems))
        return self
