"""EndpointPickerConfig (config/endpointpicker/): upstream's default and sample configs load
into a GatewayConfig; plugins poolkeeper lacks, unknown keys and bad references are errors."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from poolkeeper.config.endpointpicker import (
    DEFAULT_CONFIG_TEXT,
    load_endpoint_picker_config,
    translate,
)
from poolkeeper.config.gateway import GatewayConfig
from poolkeeper.errors import ConfigError
from poolkeeper.scheduling.build import build_scheduler

CONFIGS = Path(__file__).parent / "data" / "configs"


def _gateway(text: str, **kwargs: Any) -> tuple[GatewayConfig, tuple[str, ...]]:
    translation = translate(load_endpoint_picker_config(text, "test"), **kwargs)
    config = GatewayConfig.model_validate({"spec": dict(translation.sections)})
    return config, translation.notices


def _plugins(config: GatewayConfig) -> dict[str, dict[str, Any]]:
    return {
        p.instance_name: {"type": p.type, **p.parameters} for p in config.spec.scheduling.plugins
    }


def test_upstreams_default_config_loads_and_builds() -> None:
    config, _ = _gateway(DEFAULT_CONFIG_TEXT)
    plugins = _plugins(config)
    assert set(plugins) == {
        "queue-scorer",
        "kv-cache-utilization-scorer",
        "prefix-cache-scorer",
        "max-score-picker",
    }
    # Upstream's system default: one endpoint, not poolkeeper's pick + 3 fallbacks.
    assert plugins["max-score-picker"]["maxNumOfEndpoints"] == 1
    (profile,) = config.spec.scheduling.scheduling_profiles
    weights = {p.plugin_ref: p.weight for p in profile.plugins}
    assert weights == {
        "queue-scorer": 2,
        "kv-cache-utilization-scorer": 2,
        "prefix-cache-scorer": 3,
        "max-score-picker": None,
    }
    # Flow control is behind a feature gate that is off by default upstream.
    assert config.spec.flow_control.enabled is False
    assert config.spec.admission.standard_overload_level is None
    build_scheduler(config.spec.scheduling, rng=random.Random(0))


def test_the_charts_default_plugins_set_the_engine() -> None:
    config, _ = _gateway((CONFIGS / "chart-default-plugins.yaml").read_text())
    assert config.spec.scraping.default_engine == "sglang"
    assert config.spec.scraping.path == "/metrics"


def test_the_sim_sample_maps_the_producer_onto_the_prefix_scorer() -> None:
    config, notices = _gateway((CONFIGS / "sim-epp-config.yaml").read_text())
    plugins = _plugins(config)
    assert plugins["decode-filter"]["type"] == "decode-filter"
    # 4096 tokens at upstream's 16 tokens per block.
    assert plugins["prefix-cache-scorer"]["maxPrefixBlocks"] == 256
    assert plugins["prefix-cache-scorer"]["lruCapacityPerServer"] == 31250
    assert plugins["max-score-picker"]["maxNumOfEndpoints"] == 1
    assert any("autoTune is not implemented" in n for n in notices)
    build_scheduler(config.spec.scheduling, rng=random.Random(0))


def test_flow_control_gate_bands_detector_and_deprecated_group() -> None:
    config, notices = _gateway((CONFIGS / "flow-control.yaml").read_text())
    spec = config.spec
    assert spec.flow_control.enabled is True
    bands = spec.flow_control.bands
    assert (bands.critical.max_requests, bands.standard.max_requests) == (100, 500)
    assert bands.sheddable.max_requests == 50
    assert bands.standard.max_bytes == 512 * 2**20
    assert bands.critical.ttl_ms == bands.standard.ttl_ms == 30_000
    assert bands.standard.lifo_after_ms is None
    # upstream's order, whatever poolkeeper's own band defaults become
    assert not any(band.shortest_first for band in (bands.standard, bands.sheddable))
    assert spec.edge.epp_timeout_s > 30
    assert (spec.admission.queue_depth_threshold, spec.admission.kv_cache_util_threshold) == (
        8,
        0.9,
    )
    assert spec.scraping.staleness_ms == 500
    prefix = _plugins(config)["prefix-cache-scorer"]
    assert prefix["blockSize"] == 128  # 32 tokens of 4 characters
    assert prefix["maxPrefixBlocks"] == 256  # 8192 / 32
    assert _plugins(config)["picker"]["maxNumOfEndpoints"] == 2
    assert any(n.startswith("DEPRECATION: apiVersion") for n in notices)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("pd-epp-config.yaml", 'plugin type "disagg-profile-handler" is not implemented'),
        ("pd-epp-config.yaml", "implemented profile handlers: single-profile-handler"),
        ("pd-epp-config.yaml", "2 profiles need a multi-profile handler"),
        ("passthrough-epp-config.yaml", 'plugin type "passthrough-parser" is not implemented'),
        ("passthrough-epp-config.yaml", "implemented parsers: openai-parser"),
        ("passthrough-epp-config.yaml", "inflight-load-scorer is the nearest"),
        ("gie-v1.1-prefix-params.yaml", "plugins[0].parameters.blockSize"),
        ("gie-v1.1-prefix-params.yaml", "plugins[0].parameters.maxPrefixBlocksToMatch"),
    ],
)
def test_what_poolkeeper_cannot_do_is_a_startup_error(name: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        _gateway((CONFIGS / name).read_text())
    assert expected in info.value.message


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("plugins: [{type: nope}]", 'plugins[0].type: unknown plugin type "nope"'),
        ("plugins: []\nextra: 1", "extra"),
        ("featureGates: [fancy]\nplugins: []", "unknown or unregistered feature gate 'fancy'"),
        (
            "plugins: [{type: queue-scorer}]\nschedulingProfiles: [{name: d, plugins: "
            "[{pluginRef: missing}]}]",
            "unknown plugin 'missing'",
        ),
        ("plugins: [{type: session-affinity-scorer}]", "is not implemented"),
        (
            "plugins: [{type: max-score-picker, parameters: {maxNumOfEndpoint: 2}}]",
            "parameters.maxNumOfEndpoint",
        ),
    ],
)
def test_strict_like_upstream(text: str, expected: str) -> None:
    header = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
    with pytest.raises(ConfigError) as info:
        _gateway(header + text)
    assert expected in info.value.message


def test_removed_gates_are_tolerated_and_flag_gates_override() -> None:
    text = DEFAULT_CONFIG_TEXT.replace("featureGates: []", "featureGates: [dataLayer]")
    translation = translate(
        load_endpoint_picker_config(text, "t"), feature_gates=["flowControl=true"]
    )
    assert translation.feature_gates["flowControl"] is True
    assert any("'dataLayer' was removed" in n for n in translation.notices)


def test_poolkeepers_own_plugins_may_be_named() -> None:
    text = (
        "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n"
        "- {type: inflight-load-scorer, parameters: {unit: tokens}}\n"
    )
    config, _ = _gateway(text)
    assert _plugins(config)["inflight-load-scorer"]["unit"] == "tokens"


def test_validate_and_load_files_read_endpoint_picker_configs(tmp_path: Path) -> None:
    from poolkeeper.cli.main import main as poolkeeper_main
    from poolkeeper.controller.resource_files import load_files

    assert poolkeeper_main(["validate", str(CONFIGS / "sim-epp-config.yaml")]) == 0
    assert poolkeeper_main(["validate", str(CONFIGS / "pd-epp-config.yaml")]) == 1
    loaded = load_files([CONFIGS / "sim-epp-config.yaml"])
    assert loaded.errors == ()
    plugins = {p.instance_name for p in loaded.gateway_config.spec.scheduling.plugins}
    assert "decode-filter" in plugins
    assert any("autoTune" in n for n in loaded.notices)
    both = tmp_path / "both.yaml"
    both.write_text(
        (CONFIGS / "sim-epp-config.yaml").read_text()
        + "---\napiVersion: poolkeeper.dev/v1alpha1\nkind: GatewayConfig\nspec: {}\n"
    )
    assert any("not several" in e for e in load_files([both]).errors)


def test_a_bad_detector_reference_is_reported_once() -> None:
    text = (
        "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins: []\n"
        "saturationDetector: {pluginRef: nowhere}\n"
    )
    with pytest.raises(ConfigError) as info:
        _gateway(text)
    assert info.value.message.count("unknown plugin 'nowhere'") == 1
