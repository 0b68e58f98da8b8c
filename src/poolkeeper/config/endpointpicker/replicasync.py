"""`dataLayer.crossReplicaSyncerPluginRef` -> the GatewayConfig `replicaSync` section.

Upstream's EndpointPickerConfig names a cross-replica syncer plugin and a sync interval; here
the plugin is poolkeeper's own `udp-cross-replica-syncer` (catalogue.py: `SyncerParams`),
which sends each replica's routing decisions to its peers as they are made
(scheduling/replicasync/). So `crossReplicaSyncInterval` is not a polling period: it is how
long a replica may gather first bytes and ends before sending them together
(`replicaSync.flushIntervalMs`, default 1 ms; decisions leave at once, `sendAtOnce`), at most
1 s (older news is of little use to a peer). The syncer feeds poolkeeper's
`prefill-backlog-scorer`, which the config must name in its plugins and its profile (upstream's
default does not). The section is checked here against `ReplicaSyncConfig`, so a bad value is
reported at the parameter the user wrote (`<name>.parameters.peers`), not at the section's
field it became; the key file, read at start and again when it changes, is named the same
way (`written_at`, handed to the GatewayConfig's validation as `key_context`: `poolkeeper-epp`
and `poolkeeper serve -f` alike).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from pydantic import ValidationError

from poolkeeper.config.endpointpicker.catalogue import Params, SyncerParams
from poolkeeper.config.endpointpicker.document import DataLayer
from poolkeeper.config.endpointpicker.values import parse_duration
from poolkeeper.scheduling.replicasync.config import KEY_FIELD_CONTEXT, ReplicaSyncConfig

SYNCER_TYPE = "udp-cross-replica-syncer"
MAX_INTERVAL_S = 1.0
BACKLOG_TYPE = "prefill-backlog-scorer"
# section field -> what the user wrote (under the plugin's parameters unless it has a dot)
_WRITTEN = {
    "resolveIntervalMs": "resolveInterval",
    "maxAgeMs": "maxAge",
    "peerWakeSpreadMs": "peerWakeSpread",
    "claimGraceMs": "claimGrace",
    "reconcileIntervalMs": "reconcileInterval",
    "flushIntervalMs": "dataLayer.crossReplicaSyncInterval",
}


def written_at(name: str, ref: str) -> str:
    """Where the user wrote the section's field `name` (syncer `ref`): the plugin parameter, or
    the data layer's field. Also names the key file's runtime errors (cli/epp.py)."""
    written = _WRITTEN.get(name, name)
    return written if "." in written else f"{ref}.parameters.{written}"


def key_context(key_file_at: str | None, where: str) -> dict[str, str] | None:
    """The GatewayConfig's validation context when an EndpointPickerConfig at `where` wrote the
    key file (the translation's `key_file_at`): its errors, at start and on a reload of the
    file, name `<where>: <name>.parameters.keyFile` (`ReplicaSyncConfig.key_field`)."""
    return None if key_file_at is None else {KEY_FIELD_CONTEXT: f"{where}: {key_file_at}"}


def _ms(text: str, where: str, problems: list[str]) -> float | None:
    try:
        return parse_duration(text) * 1000.0
    except ValueError as exc:
        problems.append(f"{where}: {exc}")
        return None


def replica_sync_section(
    layer: DataLayer | None,
    params: Mapping[str, Params],
    types: Mapping[str, str],
    problems: list[str],
    profile_refs: Collection[str] = (),
) -> dict[str, Any] | None:
    """The `replicaSync` section `layer` asks for (None: no syncer), problems appended.
    `params`: the checked parameters by instance name; `types`: every instance's type;
    `profile_refs`: the instances the scheduling profiles use."""
    if layer is None or layer.cross_replica_syncer_plugin_ref is None:
        if layer is not None and layer.cross_replica_sync_interval is not None:
            problems.append(
                "dataLayer.crossReplicaSyncInterval: needs dataLayer.crossReplicaSyncerPluginRef"
            )
        return None
    where = "dataLayer.crossReplicaSyncerPluginRef"
    ref = layer.cross_replica_syncer_plugin_ref
    if ref not in types:
        problems.append(f"{where}: unknown plugin {ref!r}")
        return None
    if types[ref] != SYNCER_TYPE:
        problems.append(f"{where}: {ref!r} is a {types[ref]}, not a {SYNCER_TYPE}")
        return None
    if not any(types.get(r) == BACKLOG_TYPE for r in profile_refs):
        problems.append(
            f"{where}: the syncer needs a {BACKLOG_TYPE} in plugins and the profile (it "
            "publishes the sends that scorer records and counts the peers' in its backlog)"
        )
    syncer = params.get(ref)
    if not isinstance(syncer, SyncerParams):
        return None  # its parameters were invalid: already reported
    section: dict[str, Any] = {
        "enabled": True,
        "address": syncer.address,
        "port": syncer.port,
        "peers": list(syncer.peers),
        "peerService": syncer.peer_service,
        "origin": syncer.origin,
        "maxDatagramBytes": syncer.max_datagram_bytes,
        "sendAtOnce": syncer.send_at_once,
        "peerUnseen": syncer.peer_unseen,
    }
    if not syncer.key_file.strip():
        problems.append(
            f"{written_at('keyFile', ref)}: required: the syncer never runs unauthenticated "
            "(a file with the shared keys, one a line, at least 16 bytes each, e.g. a mounted "
            "Secret)"
        )
    section["keyFile"] = syncer.key_file if syncer.key_file.strip() else None
    section["keyOptional"] = syncer.key_optional
    for key, text in (
        ("resolveIntervalMs", syncer.resolve_interval),
        ("maxAgeMs", syncer.max_age),
        ("peerWakeSpreadMs", syncer.peer_wake_spread),
        ("reconcileIntervalMs", syncer.reconcile_interval),
    ):
        value = _ms(text, f"{ref}.parameters.{key.removesuffix('Ms')}", problems)
        if value is not None:
            section[key] = round(value)
    if syncer.claim_grace is not None:  # kept fractional: a grace is a few milliseconds
        grace = _ms(syncer.claim_grace, f"{ref}.parameters.claimGrace", problems)
        if grace is not None:
            section["claimGraceMs"] = grace
    interval = layer.cross_replica_sync_interval
    if interval is not None:
        value = _ms(interval, "dataLayer.crossReplicaSyncInterval", problems)
        if value is not None and value > MAX_INTERVAL_S * 1000.0:
            problems.append(
                f"dataLayer.crossReplicaSyncInterval: {interval} is over {MAX_INTERVAL_S:g}s: "
                "decisions are sent as they are made, gathered at most this long"
            )
        elif value is not None:
            section["flushIntervalMs"] = value
    _check(section, ref, problems)
    return section


def _check(section: Mapping[str, Any], ref: str, problems: list[str]) -> None:
    """What `ReplicaSyncConfig` refuses in `section`, named as the user wrote it."""
    try:
        ReplicaSyncConfig.model_validate(section)
    except ValidationError as exc:
        for error in exc.errors():
            field = str(error["loc"][0]) if error["loc"] else ""
            rule = (error.get("ctx") or {}).get("issues")  # the model's own rules
            for path, message in rule or ((field, error["msg"]),):
                name = path.lstrip(".") or field
                if name == "keyFile" and not section.get("keyFile"):
                    continue  # said above, in the parameter's own words
                if rule and name == "peers":
                    name = "peers/peerService"  # (the rule is about the two together)
                where = written_at(name, ref)
                unit = " (milliseconds)" if name in _WRITTEN else ""
                problems.append(f"{where}: {message}{unit}")
