"""docs/scheduling.md documents every plugin type, parameter and preset that exists."""

from __future__ import annotations

from pathlib import Path

import yaml

from poolkeeper.flowcontrol.admission import AdmissionConfig
from poolkeeper.scheduling.config import SchedulingConfig
from poolkeeper.scheduling.plugins.builtins import builtin_registry
from poolkeeper.scheduling.presets import PRESETS, preset_document

DOC = (Path(__file__).resolve().parents[2] / "docs" / "scheduling.md").read_text()


def test_every_plugin_type_and_parameter_is_documented() -> None:
    for spec in builtin_registry():
        assert f"#### `{spec.type_name}`" in DOC, spec.type_name
        for field in spec.params.model_fields.values():
            assert f"`{field.alias}`" in DOC, (spec.type_name, field.alias)


def test_every_preset_is_documented_with_its_exact_yaml() -> None:
    for name in PRESETS:
        section = DOC.split(f"#### `{name}`", 1)[1]
        block = section.split("```yaml\n", 1)[1].split("```", 1)[0]
        assert yaml.safe_load(block) == preset_document(name), name


def test_the_default_profile_yaml_in_section_3_is_the_default_preset() -> None:
    section = DOC.split("## 3. The default profile", 1)[1]
    block = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    assert SchedulingConfig.model_validate(
        yaml.safe_load(block)
    ) == SchedulingConfig.model_validate(preset_document("default"))


def test_every_admission_field_is_documented() -> None:
    for field in AdmissionConfig.model_fields.values():
        assert f"| `{field.alias}` |" in DOC, field.alias
