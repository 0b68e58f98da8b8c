"""SchedulingConfig validation (paths in every message), defaults, presets and building."""

from __future__ import annotations

import random
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from poolkeeper.config.gateway import GatewayConfig
from poolkeeper.config.load import load_text
from poolkeeper.errors import ConfigError
from poolkeeper.scheduling import config as scheduling_config, resolve
from poolkeeper.scheduling.build import build_scheduler
from poolkeeper.scheduling.config import SchedulingConfig, preset_config
from poolkeeper.scheduling.plugins.builtins import builtin_registry
from poolkeeper.scheduling.presets import PRESETS, preset_document
from poolkeeper.scheduling.registry import NoParams, PluginKind, PluginSpec
from tests.scheduling.sched_factories import request, scheduler, state


def problems(doc: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as info:
        SchedulingConfig.model_validate(doc)
    return str(info.value)


def profile(*refs: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"name": "p", "plugins": list(refs)}]


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        (
            {"plugins": [{"type": "queue-scorer"}, {"type": "nope"}]},
            'plugins[1].type: unknown plugin type "nope"',
        ),
        (
            {"plugins": [{"type": "queue-scorer"}, {"type": "queue-scorer"}]},
            'plugins[1].name: duplicate plugin name "queue-scorer" (also plugins[0])',
        ),
        (
            {"plugins": [{"type": "prefix-cache-scorer", "parameters": {"blockSize": 0}}]},
            "plugins[0].parameters.blockSize: Input should be greater than or equal to 1",
        ),
        (
            {"plugins": [{"type": "queue-scorer", "parameters": {"treshold": 1}}]},
            "plugins[0].parameters.treshold: Extra inputs are not permitted",
        ),
        (
            {
                "plugins": [{"type": "queue-scorer"}, {"type": "max-score-picker"}],
                "schedulingProfiles": profile(
                    {"pluginRef": "queue-scorer"}, {"pluginRef": "max-score-picker"},
                    {"pluginRef": "x"},
                ),
            },
            'schedulingProfiles[0].plugins[2].pluginRef: unknown plugin "x"',
        ),
        (
            {
                "plugins": [{"type": "random-picker"}, {"type": "max-score-picker"}],
                "schedulingProfiles": profile(
                    {"pluginRef": "random-picker"}, {"pluginRef": "max-score-picker"}
                ),
            },
            "schedulingProfiles[0].plugins: exactly one picker per profile, got 2",
        ),
        (
            {
                "plugins": [{"type": "low-queue-filter"}],
                "schedulingProfiles": profile({"pluginRef": "low-queue-filter", "weight": 2}),
            },
            'schedulingProfiles[0].plugins[0].weight: only scorers take a weight ("low-queue-filter" is a filter)',  # noqa: E501
        ),
        (
            {
                "plugins": [{"type": "queue-scorer"}],
                "schedulingProfiles": profile(
                    {"pluginRef": "queue-scorer"}, {"pluginRef": "queue-scorer"}
                ),
            },
            'schedulingProfiles[0].plugins[1].pluginRef: plugin "queue-scorer" is listed twice',
        ),
        (
            {
                "plugins": [{"type": "queue-scorer"}],
                "schedulingProfiles": [
                    {"name": "a", "plugins": [{"pluginRef": "queue-scorer"}]},
                    {"name": "a", "plugins": [{"pluginRef": "queue-scorer"}]},
                ],
            },
            'schedulingProfiles[1].name: duplicate profile "a"',
        ),
        (
            {
                "plugins": [{"type": "queue-scorer"}],
                "schedulingProfiles": [
                    {"name": "a", "plugins": [{"pluginRef": "queue-scorer"}]},
                    {"name": "b", "plugins": [{"pluginRef": "queue-scorer"}]},
                ],
            },
            "single-profile-handler runs exactly one profile, but 2 are configured",
        ),
        (
            {"plugins": [{"type": "queue-scorer"}], "profileHandler": "queue-scorer"},
            'profileHandler: "queue-scorer" is a scorer, not a profile handler',
        ),
        (
            {"plugins": [{"type": "queue-scorer"}], "profileHandler": "h"},
            'profileHandler: unknown plugin "h"',
        ),
        (
            {"preset": "gie-v9"},
            'preset: unknown preset "gie-v9"',
        ),
        (
            {"preset": "default", "plugins": [{"type": "queue-scorer"}]},
            "preset: a preset cannot be combined with plugins",
        ),
        (
            {
                "plugins": [
                    {"type": "queue-scorer"},
                    {
                        "type": "decision-tree-filter",
                        "parameters": {
                            "current": {"pluginRef": "queue-scorer"},
                            "nextOnFailure": {"decisionTree": {"current": "ghost"}},
                        },
                    },
                ]
            },
            'plugins[1].parameters.current.pluginRef: "queue-scorer" is a scorer, not a filter',
        ),
        (
            {
                "plugins": [
                    {
                        "type": "decision-tree-filter",
                        "parameters": {
                            "current": "least-queue-filter",
                            "nextOnFailure": {"decisionTree": {"current": "ghost"}},
                        },
                    },
                ]
            },
            'plugins[0].parameters.nextOnFailure.decisionTree.current: unknown plugin "ghost"',
        ),
        (
            {
                "plugins": [
                    {"type": "decision-tree-filter", "name": "a", "parameters": {"current": "b"}},
                    {"type": "decision-tree-filter", "name": "b", "parameters": {"current": "a"}},
                ]
            },
            "decision trees refer to each other in a cycle (a -> b -> a)",
        ),
        (
            {
                "plugins": [
                    {
                        "type": "decision-tree-filter",
                        "parameters": {
                            "current": {"pluginRef": "x", "decisionTree": {"current": "y"}}
                        },
                    }
                ]
            },
            "give exactly one of pluginRef or decisionTree",
        ),
        (
            {"plugins": [{"type": "queue-scorer"}], "schedulingProfile": []},
            "Extra inputs are not permitted",
        ),
    ],
    ids=[
        "unknown-type", "duplicate-name", "bad-param", "unknown-param", "unknown-ref",
        "two-pickers", "weight-on-filter", "listed-twice", "duplicate-profile",
        "single-handler-two-profiles", "handler-kind", "handler-unknown", "unknown-preset",
        "preset-and-plugins", "tree-ref-kind", "tree-ref-unknown", "tree-cycle", "tree-node-both",
        "unknown-top-level-key",
    ],
)  # fmt: skip
def test_invalid_config_reports_path(doc: dict[str, Any], message: str) -> None:
    assert message in problems(doc)


def test_every_problem_is_reported_at_once() -> None:
    text = problems(
        {
            "plugins": [{"type": "nope"}, {"type": "queue-scorer", "parameters": {"x": 1}}],
            "schedulingProfiles": profile({"pluginRef": "missing"}),
        }
    )
    assert "plugins[0].type" in text
    assert "plugins[1].parameters.x" in text
    assert "schedulingProfiles[0].plugins[0].pluginRef" in text


def test_defaults_weight_picker_and_handler() -> None:
    sched = scheduler(
        {
            "plugins": [{"type": "queue-scorer"}, {"type": "kv-cache-scorer", "name": "kv"}],
            "schedulingProfiles": profile({"pluginRef": "queue-scorer"}, {"pluginRef": "kv"}),
        }
    )
    prof = sched.profiles["p"]
    assert [w.weight for w in prof.scorers] == [1.0, 1.0]
    assert prof.picker.typed_name.type == "max-score-picker"
    assert sched.handler.typed_name.type == "single-profile-handler"
    assert prof.scorers[1].scorer.typed_name.type == "kv-cache-utilization-scorer"  # alias


def test_plugins_without_profiles_make_one_default_profile_in_order() -> None:
    sched = scheduler(
        {
            "plugins": [
                {"type": "low-queue-filter"},
                {"type": "queue-scorer"},
                {"type": "random-picker"},
            ]
        }
    )
    prof = sched.profiles["default"]
    assert [f.typed_name.name for f in prof.filters] == ["low-queue-filter"]
    assert [w.scorer.typed_name.name for w in prof.scorers] == ["queue-scorer"]
    assert prof.picker.typed_name.name == "random-picker"


def test_default_profile_leaves_out_filters_used_inside_trees() -> None:
    sched = scheduler(
        {
            "plugins": [
                {"type": "drop-request-filter", "name": "drop"},
                {"type": "has-capacity-filter", "name": "cap"},
                {
                    "type": "decision-tree-filter",
                    "name": "tree",
                    "parameters": {"current": "cap", "nextOnFailure": "drop"},
                },
            ]
        }
    )
    assert [f.typed_name.name for f in sched.profiles["default"].filters] == ["tree"]
    assert sched.schedule(request(), [state(1)], now=100.0).primary.key == state(1).key


def test_empty_config_is_the_default_preset() -> None:
    sched = build_scheduler(SchedulingConfig(), rng=random.Random(0))
    assert sched.source == "preset default"
    by_name = {w.scorer.typed_name.name: w.weight for w in sched.profiles["default"].scorers}
    assert by_name == {
        "queue-scorer": 2,
        "running-requests-size-scorer": 1,
        "kv-cache-utilization-scorer": 1,
        "prefix-cache-scorer": 3,
        "lora-affinity-scorer": 2,
        "observed-speed-scorer": 2,
        "prefill-backlog-scorer": 2,
    }
    assert [f.typed_name.type for f in sched.profiles["default"].filters] == [
        "stale-metrics-filter",
        "saturation-filter",
    ]
    # the default before issue 38's switch, kept by name
    classic = build_scheduler(preset_config("classic"), rng=random.Random(0))
    assert "prefill-backlog-scorer" not in classic.plugins
    assert [f.typed_name.type for f in classic.profiles["default"].filters] == [
        "stale-metrics-filter"
    ]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_builds_and_schedules(name: str) -> None:
    sched = build_scheduler(SchedulingConfig(preset=name), rng=random.Random(0))
    assert sched.source == f"preset {name}"
    pool = [state(1, waiting=1), state(2), state(3, waiting=2)]
    result = sched.schedule(request(prompt="p" * 300), pool, now=100.0)
    assert result.primary.key in {s.key for s in pool}
    # The preset document is what the config docs show; building it directly is equivalent.
    assert preset_config(name) == SchedulingConfig.model_validate(preset_document(name))


def test_gie_v1_default_weights() -> None:
    sched = build_scheduler(preset_config("gie-v1-default"), rng=random.Random(0))
    by_name = {w.scorer.typed_name.name: w.weight for w in sched.profiles["default"].scorers}
    assert by_name == {
        "queue-scorer": 2,
        "kv-cache-utilization-scorer": 2,
        "prefix-cache-scorer": 3,
    }


def test_preset_config_unknown_name() -> None:
    with pytest.raises(KeyError, match="known: classic, default"):
        preset_config("nope")


def test_custom_registry_plugin_type() -> None:
    from poolkeeper.scheduling.plugins.filters import CriticalRequestFilter

    registry = builtin_registry()
    registry.register(
        PluginSpec(
            "my-filter",
            PluginKind.FILTER,
            NoParams,
            lambda tn, p, ctx: CriticalRequestFilter(tn),
            "custom",
        )
    )
    doc = {"plugins": [{"type": "my-filter"}]}
    with pytest.raises(ValidationError, match='unknown plugin type "my-filter"'):
        SchedulingConfig.model_validate(doc)
    config = SchedulingConfig.model_validate(doc, context={"registry": registry})
    sched = build_scheduler(config, rng=random.Random(0), registry=registry)
    assert "my-filter" in sched.plugins
    with pytest.raises(ConfigError, match="unknown plugin type"):
        build_scheduler(config, rng=random.Random(0))  # builtin registry lacks it


def test_registry_rejects_double_registration() -> None:
    registry = builtin_registry()
    spec = registry.get("queue-scorer")
    assert spec is not None
    with pytest.raises(ValueError, match="already registered"):
        registry.register(spec)


def test_every_registered_type_has_documented_parameters() -> None:
    registry = builtin_registry()
    for spec in registry:
        for name, field in spec.params.model_fields.items():
            assert field.description, f"{spec.type_name}.{name} lacks a description"


@pytest.mark.parametrize(
    "scheduling",
    [
        None,  # section omitted: the default preset
        {"preset": "gie-v0.3-decision-tree"},
        {"plugins": [{"type": "queue-scorer"}, {"type": "random-picker"}]},
    ],
)
def test_gateway_config_load_resolves_scheduling_once(
    scheduling: dict[str, Any] | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[object] = []

    def counting(doc: Any, registry: Any) -> Any:
        calls.append(doc)
        return resolve.resolve(doc, registry)

    monkeypatch.setattr(scheduling_config, "resolve", counting)
    spec = {} if scheduling is None else {"scheduling": scheduling}
    text = yaml.safe_dump(
        {"apiVersion": "poolkeeper.dev/v1alpha1", "kind": "GatewayConfig", "spec": spec}
    )
    result = load_text(text, "gw.yaml")
    assert result.ok, result.errors
    config = result.objects_of(GatewayConfig)[0]
    build_scheduler(config.spec.scheduling, rng=random.Random(0))
    assert len(calls) == 1


def test_building_against_another_registry_resolves_again() -> None:
    config = SchedulingConfig(preset="default")
    assert config.plan() is config.plan()
    registry = builtin_registry()
    assert config.plan(registry) is not config.plan()
    assert config.plan(registry) == config.plan()
