"""Cross-replica sync's configuration: the GatewayConfig section refuses to run unauthenticated,
and an EndpointPickerConfig's `dataLayer.crossReplicaSyncerPluginRef` translates into it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from poolkeeper.cli.epp_flags import parse_epp_args
from poolkeeper.cli.epp_setup import epp_gateway_config
from poolkeeper.config.endpointpicker import load_endpoint_picker_config, translate
from poolkeeper.config.gateway import GatewayConfig
from poolkeeper.controller.files import file_source
from poolkeeper.errors import ConfigError
from poolkeeper.netutil import free_ports
from poolkeeper.scheduling.replicasync.config import ReplicaSyncConfig
from poolkeeper.server.options import ServeOptions
from poolkeeper.server.runtime import GatewayRuntime
from tests.support.gateway_files import one_pool

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
        ({"sendAtOnce": "sometimes"}, r"replicaSync\.sendAtOnce\n.*valid boolean"),
        ({"peerUnseen": [True]}, r"replicaSync\.peerUnseen\n.*valid boolean"),
        ({"peerUnseeen": False}, "peerUnseeen"),
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
    # Decisions leave at once and peers' unseen sends count: the section's defaults.
    assert (section["sendAtOnce"], section["peerUnseen"]) == (True, True)
    defaults = GatewayConfig.model_validate({"spec": {"replicaSync": section}})
    assert defaults.spec.replica_sync.send_at_once
    assert defaults.spec.replica_sync.peer_unseen
    assert section["maxDatagramBytes"] == 1232
    assert section["reconcileIntervalMs"] == 1000
    more = text.replace(
        "resolveInterval: 2s",
        "resolveInterval: 2s, maxDatagramBytes: 1400, reconcileInterval: 250ms",
    )
    assert _translate(more)["maxDatagramBytes"] == 1400
    assert _translate(more)["reconcileIntervalMs"] == 250
    # Both can be turned off, as in the section itself.
    off = _translate(text.replace("resolveInterval: 2s", "resolveInterval: 2s, "
                                  "sendAtOnce: false, peerUnseen: false"))  # fmt: skip
    assert (off["sendAtOnce"], off["peerUnseen"]) == (False, False)
    checked = GatewayConfig.model_validate({"spec": {"replicaSync": off}}).spec.replica_sync
    assert (checked.send_at_once, checked.peer_unseen) == (False, False)


def test_claim_grace_is_a_syncer_parameter_in_milliseconds() -> None:
    text = PLUGINS + "dataLayer:\n  crossReplicaSyncerPluginRef: sync\n"
    # Unwritten: the section's own default (one home for it), not a copy in the plugin.
    assert "claimGraceMs" not in _translate(text)
    default = ReplicaSyncConfig.model_fields["claim_grace_ms"].default
    assert _spec({"peerService": "p"}).spec.replica_sync.claim_grace_ms == default
    grace = _translate(
        text.replace("resolveInterval: 2s", "resolveInterval: 2s, claimGrace: 2.5ms")
    )
    assert grace["claimGraceMs"] == 2.5  # kept fractional, not rounded to 2 or 3
    off = _translate(text.replace("resolveInterval: 2s", "resolveInterval: 2s, claimGrace: 0s"))
    assert (
        GatewayConfig.model_validate(
            {"spec": {"replicaSync": off}}
        ).spec.replica_sync.claim_grace_ms
        == 0
    )


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
            PLUGINS.replace("resolveInterval: 2s", "claimGrace: 1s")
            + "dataLayer: {crossReplicaSyncerPluginRef: sync}\n",
            "sync.parameters.claimGrace: Input should be less than or equal to 100 (milliseconds)",
        ),
        (
            PLUGINS.replace("resolveInterval: 2s", "claimGrace: soon")
            + "dataLayer: {crossReplicaSyncerPluginRef: sync}\n",
            "sync.parameters.claimGrace: ",
        ),
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


def test_key_optional_is_a_syncer_parameter_off_by_default() -> None:
    text = PLUGINS + "dataLayer: {crossReplicaSyncerPluginRef: sync}\n"
    assert _translate(text)["keyOptional"] is False  # as spec.replicaSync's default
    section = _translate(text.replace("keyFile: /etc/sync/key", "keyFile: /k, keyOptional: true"))
    assert section["keyOptional"] is True
    assert _spec(section).spec.replica_sync.key_optional is True
    bad = text.replace("keyFile: /etc/sync/key", "keyFile: /k, keyOptional: maybe")
    with pytest.raises(ConfigError, match=r"parameters\.keyOptional"):
        translate(load_endpoint_picker_config(HEADER + bad, "t"))


def _epp_config(tmp_path: Path, key: Path, optional: bool = False) -> tuple[Path, GatewayConfig]:
    """The `poolkeeper-epp` settings for an EndpointPickerConfig file whose syncer reads `key`."""
    params = f"keyFile: {key}, keyOptional: {str(optional).lower()}"
    path = tmp_path / "plugins.yaml"
    path.write_text(
        HEADER
        + PLUGINS.replace("keyFile: /etc/sync/key", params)
        + "dataLayer: {crossReplicaSyncerPluginRef: sync}\n"
    )
    args = parse_epp_args(["--pool-name=p", f"--config-file={path}"])
    return path, epp_gateway_config(args)[0]


@pytest.mark.integration
async def test_an_optional_key_not_created_yet_starts_the_epp_without_sync(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    missing = tmp_path / "secret" / "key"  # an optional Secret volume, the Secret not created
    missing.parent.mkdir()
    _, config = _epp_config(tmp_path, missing, optional=True)
    section = config.spec.replica_sync.model_dump(by_alias=True, exclude_unset=True)
    spec = f"  replicaSync: {json.dumps(section)}\n"
    (sim,) = free_ports(1)
    options = ServeOptions(
        source=file_source([one_pool(tmp_path / "cfg", sim, spec=spec)]),
        run_envoy=False,
        ready_wait_s=0,
    )
    runtime = GatewayRuntime(options)
    await runtime.start()
    try:
        assert runtime._sync is not None
        assert runtime._sync.running is None
        assert f"replica sync stays off: spec.replicaSync.keyFile {missing}" in caplog.text
    finally:
        await runtime.stop(grace_s=0)


@pytest.mark.parametrize(
    ("content", "optional", "expected"),
    [
        (None, False, "cannot read"),
        (b"short\n", False, "line 1 holds 5 bytes"),
        (b"0123456789abcdef\x01" * 2 + b"\n", False, "control"),
        (None, True, "does not exist, but"),  # the directory holds another file
    ],
)
def test_a_bad_key_is_named_by_the_syncer_parameter(
    tmp_path: Path, content: bytes | None, optional: bool, expected: str
) -> None:
    key = tmp_path / "secret" / "key"
    key.parent.mkdir()
    if content is None:
        (key.parent / "other").write_text("x" * 32)
    else:
        key.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        _epp_config(tmp_path, key, optional)
    path = tmp_path / "plugins.yaml"
    assert info.value.message.startswith(f"{path}: sync.parameters.keyFile: ")
    assert expected in info.value.message


def _serve_files(tmp_path: Path, key: Path) -> Path:
    """A directory `poolkeeper serve -f` reads: a pool, and an EndpointPickerConfig whose
    syncer reads `key`."""
    files = tmp_path / "cfg"
    files.mkdir()
    (files / "pool.yaml").write_text(
        "apiVersion: inference.networking.x-k8s.io/v1alpha2\nkind: InferencePool\n"
        "metadata: {name: pool, namespace: default}\n"
        "spec: {selector: {app: sim}, targetPortNumber: 8000, extensionRef: {name: epp}}\n"
    )
    (files / "epc.yaml").write_text(
        HEADER
        + PLUGINS.replace("keyFile: /etc/sync/key", f"keyFile: {key}")
        + "dataLayer: {crossReplicaSyncerPluginRef: sync}\n"
    )
    return files


@pytest.mark.integration
def test_serve_names_a_bad_key_by_the_syncer_parameter(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from poolkeeper.cli.main import main

    key = tmp_path / "key"
    key.write_bytes(b"short\n")
    files = _serve_files(tmp_path, key)
    argv = ["serve", "-f", str(files), "--no-envoy", "--event-loop", "asyncio"]
    assert main([*argv, "--log-format", "text"]) != 0
    error = capsys.readouterr().err
    assert f"error: {files / 'epc.yaml'}: sync.parameters.keyFile: {key} line 1 holds 5" in error
    assert "spec.replicaSync.keyFile" not in error


def test_the_kubernetes_one_endpoint_default_keeps_where_the_key_was_written(
    tmp_path: Path,
) -> None:
    from poolkeeper.cli.serve_setup import one_endpoint_unless_set
    from poolkeeper.controller.resource_files import load_files

    key = tmp_path / "key"
    key.write_text("k" * 32 + "\n")
    loaded = load_files([_serve_files(tmp_path, key) / "epc.yaml"])
    assert loaded.errors == ()
    where = f"{tmp_path / 'cfg' / 'epc.yaml'}: sync.parameters.keyFile"
    assert loaded.gateway_config.spec.replica_sync.key_field == where
    config = one_endpoint_unless_set(loaded.gateway_config)
    assert config.spec.request_handling.fallback_endpoints == 0
    assert config.spec.replica_sync.key_field == where
