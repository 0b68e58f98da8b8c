"""Cross-replica sync's configuration: the GatewayConfig section refuses to run unauthenticated,
and an EndpointPickerConfig's `dataLayer.crossReplicaSyncerPluginRef` translates into it."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from poolkeeper.config.endpointpicker import load_endpoint_picker_config, translate
from poolkeeper.config.gateway import GatewayConfig
from poolkeeper.errors import ConfigError

HEADER = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
PLUGINS = """plugins:
- {type: queue-scorer}
- {type: prefix-cache-scorer}
- {type: prefill-backlog-scorer}
- name: sync
  type: udp-cross-replica-syncer
  parameters: {keyFile: /etc/sync/key, peerService: "epp-peers.ns.svc", resolveInterval: 2s}
"""


def _spec(section: dict[str, object]) -> GatewayConfig:
    return GatewayConfig.model_validate({"spec": {"replicaSync": section}})


def test_sync_is_off_by_default_and_never_on_without_a_key() -> None:
    assert GatewayConfig.default().spec.replica_sync.enabled is False
    with pytest.raises(ValidationError, match="needs a shared key file"):
        _spec({"enabled": True, "peers": ["10.0.0.1:9010"]})
    with pytest.raises(ValidationError, match="needs a shared key file"):
        _spec({"enabled": True, "keyFile": "  ", "peers": ["10.0.0.1:9010"]})
    with pytest.raises(ValidationError, match="needs peers or peerService"):
        _spec({"enabled": True, "keyFile": "/k"})
    config = _spec({"enabled": True, "keyFile": "/k", "peerService": "epp-peers:9999"})
    assert config.spec.replica_sync.service_address() == ("epp-peers", 9999)
    assert _spec({"peerService": "epp-peers"}).spec.replica_sync.service_address() == (
        "epp-peers", 9010
    )  # fmt: skip


@pytest.mark.parametrize(
    ("section", "expected"),
    [
        ({"peers": ["10.0.0.1"]}, "expected ip:port"),
        ({"peerService": ""}, "not empty"),
        ({"port": 0}, "greater than or equal to 1"),
        ({"flushIntervalMs": 5000}, "less than or equal to 1000"),
        ({"peerService": "a" * 64 + ".svc:9010"}, "not a valid DNS name"),
        ({"peers": ["a" * 64 + ".svc:9010"]}, "not a valid DNS name"),
        ({"maxDatagramBytes": 512}, "greater than or equal to 1024"),
    ],
)
def test_bad_sections_are_refused(section: dict[str, object], expected: str) -> None:
    with pytest.raises(ValidationError, match=expected):
        _spec(section)


def _translate(text: str) -> dict[str, object]:
    translation = translate(load_endpoint_picker_config(HEADER + text, "t"))
    section = dict(translation.sections["replicaSync"])
    GatewayConfig.model_validate({"spec": dict(translation.sections)})  # it loads
    return section


def test_the_syncer_plugin_becomes_the_section() -> None:
    text = PLUGINS + "dataLayer:\n  crossReplicaSyncerPluginRef: sync\n"
    text += "  crossReplicaSyncInterval: 5ms\n"
    section = _translate(text)
    assert section["enabled"] is True
    assert section["keyFile"] == "/etc/sync/key"
    assert section["peerService"] == "epp-peers.ns.svc"
    assert section["resolveIntervalMs"] == 2000
    assert section["flushIntervalMs"] == 5.0  # the interval: how long decisions gather
    assert section["peerWakeSpreadMs"] == 20
    assert section["maxDatagramBytes"] == 1232
    assert section["reconcileIntervalMs"] == 1000
    more = text.replace(
        "resolveInterval: 2s",
        "resolveInterval: 2s, maxDatagramBytes: 1400, reconcileInterval: 250ms",
    )
    assert _translate(more)["maxDatagramBytes"] == 1400
    assert _translate(more)["reconcileIntervalMs"] == 250


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            PLUGINS.replace("keyFile: /etc/sync/key, ", "")
            + "dataLayer: {crossReplicaSyncerPluginRef: sync}\n",
            "sync.parameters.keyFile: required",
        ),
        (PLUGINS + "dataLayer: {crossReplicaSyncerPluginRef: nope}\n", "unknown plugin 'nope'"),
        (
            PLUGINS + "dataLayer: {crossReplicaSyncerPluginRef: queue-scorer}\n",
            "is a queue-scorer, not a udp-cross-replica-syncer",
        ),
        (
            PLUGINS.replace("- {type: prefill-backlog-scorer}\n", "")
            + "dataLayer: {crossReplicaSyncerPluginRef: sync}\n",
            "needs a prefill-backlog-scorer",
        ),
        (
            PLUGINS
            + "schedulingProfiles:\n- name: default\n  plugins: [{pluginRef: queue-scorer}]\n"
            + "dataLayer: {crossReplicaSyncerPluginRef: sync}\n",
            "needs a prefill-backlog-scorer in plugins and the profile",
        ),
        (
            PLUGINS.replace("keyFile: /etc/sync/key", 'keyFile: "  "')
            + "dataLayer: {crossReplicaSyncerPluginRef: sync}\n",
            "sync.parameters.keyFile: required",
        ),
        (
            PLUGINS.replace('peerService: "epp-peers.ns.svc", ', "")
            + "dataLayer: {crossReplicaSyncerPluginRef: sync}\n",
            "sync.parameters.peers/peerService: Required value",
        ),
        (
            PLUGINS.replace("epp-peers.ns.svc", "a" * 64 + ".svc")
            + "dataLayer: {crossReplicaSyncerPluginRef: sync}\n",
            "sync.parameters.peerService: Value error",
        ),
        (
            PLUGINS.replace("resolveInterval: 2s", "resolveInterval: 1ms")
            + "dataLayer: {crossReplicaSyncerPluginRef: sync}\n",
            "sync.parameters.resolveInterval: Input should be greater than or equal to 100",
        ),
        (
            PLUGINS.replace("resolveInterval: 2s", "reconcileInterval: 20s")
            + "dataLayer: {crossReplicaSyncerPluginRef: sync}\n",
            "sync.parameters.reconcileInterval: Input should be less than or equal to 10000",
        ),
        (
            PLUGINS + "dataLayer: {crossReplicaSyncerPluginRef: sync, "
            "crossReplicaSyncInterval: 5s}\n",
            "is over 1s",
        ),
        (PLUGINS + "dataLayer: {crossReplicaSyncInterval: 5ms}\n", "needs dataLayer.crossRep"),
        (
            PLUGINS.replace("resolveInterval: 2s", "secret: x")
            + "dataLayer: {crossReplicaSyncerPluginRef: sync}\n",
            "parameters.secret",
        ),
    ],
)
def test_what_cannot_run_is_a_startup_error(text: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        translate(load_endpoint_picker_config(HEADER + text, "t"))
    assert expected in info.value.message
