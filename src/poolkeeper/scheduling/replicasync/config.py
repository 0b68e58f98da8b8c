"""The `spec.replicaSync` section: cross-replica sync between active-active EPP replicas.

Declared here, beside the transport it configures (`config/gateway.py` gathers the sections);
an EndpointPickerConfig's `dataLayer.crossReplicaSyncerPluginRef` is translated into it
(`config/endpointpicker/replicasync.py`). Off by default: one replica has no one to tell.
Security by default: on means authenticated; a section that turns it on without a key file is
refused at load, and a key file that cannot be read or is too short at start.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Self

from pydantic import Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from poolkeeper.api.fielderrors import go_value, rule_error
from poolkeeper.hostport import split_hostport
from poolkeeper.scheduling.replicasync.codec import MAX_KEYS, MIN_KEY_BYTES
from poolkeeper.scheduling.replicasync.discovery import check_name, parse_peers
from poolkeeper.scheduling.replicasync.wire import DEFAULT_DATAGRAM, MAX_DATAGRAM, MIN_DATAGRAM
from poolkeeper.schema import CamelModel, Port

DEFAULT_PORT = 9010
KEY_FIELD = "spec.replicaSync.keyFile"  # what the key's errors name unless told otherwise
# The validation context's key naming where `keyFile` was written instead (an
# EndpointPickerConfig's syncer parameter: `<config file>: <name>.parameters.keyFile`).
KEY_FIELD_CONTEXT = "replicaSyncKeyField"


class ReplicaSyncConfig(CamelModel, use_attribute_docstrings=True):
    """Each replica tells the others its own routing decisions (a request sent to an endpoint
    with its prompt tokens and prefix blocks, its first byte, its end) over UDP, so every
    replica's prefill backlog, approximate prefix index and pending heads count all replicas'
    sends, not only its own (docs/kubernetes.md, "Active-active replicas with sync"). Needs a
    `prefill-backlog-scorer` in the scheduling profile (the default has one)."""

    enabled: bool = False
    """Run the syncer. Needs `keyFile`."""
    address: str = "0.0.0.0"
    """Address the UDP socket binds (`127.0.0.1` for replicas on one host; `::` where peers
    have IPv6 addresses: IPv4 peers are then reached through mapped addresses)."""
    port: Port = DEFAULT_PORT
    """UDP port of the syncer, the same on every replica behind a Service."""
    peers: list[str] = Field(default_factory=list)
    """Peers as `host:port` (names are resolved, and re-resolved every `resolveIntervalMs`)."""
    peer_service: str | None = None
    """A DNS name whose addresses are the replicas, usually the EPP's headless Service
    (`epp-peers.<namespace>.svc`): `name` (at `port`) or `name:port`. Re-resolved every
    `resolveIntervalMs`; this replica's own address is left out."""
    resolve_interval_ms: int = Field(default=5000, ge=100, le=600_000)
    """How often peer names are resolved again (a scaled or rolled Deployment)."""
    key_file: str | None = None
    """File holding the shared keys, one text or base64 key per line (at least 16 bytes each,
    surrounding whitespace ignored; blank lines and lines starting with `#` are skipped; a
    line with control bytes, a raw binary key, is refused), e.g. a mounted Secret. Datagrams
    are signed with HMAC-SHA256 under the first key and accepted under any of them (at most
    4), so a key is rotated without a window in which replicas reject each other
    (docs/kubernetes.md, "Rotating the sync key"); anything else is rejected. Read at start,
    and again when it changes while running (checked every `reconcileIntervalMs`: a mounted
    Secret's update is followed without a restart); a changed file that does not read keeps
    the keys in use, with an error naming the file and line."""
    key_optional: bool = False
    """A `keyFile` that does not exist in an existing, empty directory (what an optional
    Secret volume mounts without its Secret; the kubelet's hidden `..data` entries aside)
    leaves sync off (a warning at start says how to create it, and
    `poolkeeper_replica_sync_enabled` is 0) instead of stopping the start: the shipped
    deployment has sync on and mounts its key Secret as an optional volume, so it runs before
    the Secret exists and starts syncing once the key file appears (checked every
    `reconcileIntervalMs`, no restart needed). Anything else still stops
    the start, naming the field: the directory missing (a wrong mountPath), other files in it
    (the Secret's data key is not the file's name), a path that cannot be checked, a key file
    that cannot be read or holds a bad key: sync never runs unauthenticated, nor stays off
    for good through a typo."""
    reconcile_interval_ms: int = Field(default=1000, ge=100, le=10_000)
    """How often a replica tells its peers which of its sends are still open (also its
    heartbeat): a peer drops the entries the statement no longer lists, so one whose first
    byte or end was lost in transit (UDP) stops counting after about this long, not after the
    backlog's 60 s age limit. A statement fills at most one datagram (about 140 open sends at
    the default size; more are stated in rotating slices)."""
    flush_interval_ms: float = Field(default=1.0, ge=0, le=1000)
    """How long a replica gathers its first bytes and ends (and, with `sendAtOnce` off, its
    decisions) before sending them in one datagram (0: at the end of the loop iteration that
    made them)."""
    send_at_once: bool = True
    """A decision (a request sent to an endpoint) leaves at the end of the loop iteration that
    made it, not after `flushIntervalMs`: replicas deciding within a millisecond of each other
    read the same state and send to the same best endpoint, so a peer must learn of a send
    well under one (docs/notes/2026-12-07-replicas-sub-ms.md). About 2.2 datagrams per request
    and peer, against 2.0 when gathered for 1 ms."""
    peer_unseen: bool = True
    """Count the peers' sends since each endpoint's last scrape in this replica's view of it
    (the queue, running-requests and KV scorers' and the saturation filter's unseen requests,
    as its own sends are), not only in the prefill backlog and the prefix index: without it
    each replica sees about 1/N of the sends between two scrapes. Pays off only when peers'
    sends arrive well under a millisecond after the decision (`sendAtOnce`). Not in a pool
    whose endpoints have listed LoRA adapters: measured there, single points lose up to 1.2x
    p90 and 3 % of goodput against leaving it out (docs/notes/2026-12-07-lora-unseen.md)."""
    peer_wake_spread_ms: float = Field(default=20.0, ge=0, le=1000)
    """After a peer's batch, flow control's held requests are asked again after a random delay
    of up to this (0: at once): woken together by the same peer's first byte, the replicas
    would all send their held new prefixes to the one server whose backlog just fell."""
    claim_grace_ms: float = Field(default=5.0, ge=0, le=100)
    """The room a peer's first byte frees on its server goes first to that peer (the replica
    whose request's first byte it was): this replica's held new prefixes count that room as
    still taken for this long (0: off), by when the owner's release onto it, if any, has arrived
    as a send; the peers' wake is delayed by it too. Why: replicas woken by one first byte each
    released a held new prefix onto the one freed server, none yet counting the others' (uneven
    cold starts, docs/notes/2026-12-07-release-claim.md). The cost: a new prefix may wait this
    much longer; measured live level or better with 2 and 4 replicas, inert off shared prefixes
    (docs/notes/2026-12-07-claim-default.md). Acts only with `flowControl.holdNewPrefixes`;
    an EndpointPickerConfig's `udp-cross-replica-syncer` sets it as `claimGrace` (a duration,
    e.g. `5ms`)."""
    max_datagram_bytes: int = Field(default=DEFAULT_DATAGRAM, ge=MIN_DATAGRAM, le=MAX_DATAGRAM)
    """Largest datagram sent or accepted, the same on every replica (larger ones are rejected
    before their tag is computed). The default is never fragmented on an IPv6 path or a pod
    overlay; a decision whose prefix blocks do not fit sends its first blocks only. Raise it
    only where the path MTU allows (fragments are lost together)."""
    max_age_ms: int = Field(default=10_000, ge=100, le=600_000)
    """A batch whose origin's clock is further than this from ours is rejected (replays;
    replicas' clocks must agree within it)."""
    origin: str | None = None
    """This replica's name in the exchange (default `$POD_NAME`, else the host name); a random
    boot id is appended, so a restarted replica is a new origin."""
    _key_field: str = PrivateAttr(default=KEY_FIELD)

    @model_validator(mode="after")
    def _named_where_written(self, info: ValidationInfo) -> Self:
        # The key file is read at start and again when it changes, long after validation:
        # its errors name where the user wrote it (`key_field`).
        context = info.context
        if isinstance(context, Mapping) and isinstance(at := context.get(KEY_FIELD_CONTEXT), str):
            self._key_field = at
        return self

    @property
    def key_field(self) -> str:
        """What the key file's errors name: `spec.replicaSync.keyFile`, or where an
        EndpointPickerConfig wrote it (handed in the validation context, `KEY_FIELD_CONTEXT`)."""
        return self._key_field

    @field_validator("peers")
    @classmethod
    def _peers_parse(cls, value: list[str]) -> list[str]:
        parse_peers(value)  # ValueError naming the bad entry
        return value

    @field_validator("peer_service")
    @classmethod
    def _service_parses(cls, value: str | None) -> str | None:
        if value is not None:
            split_service(value, DEFAULT_PORT)
        return value

    @model_validator(mode="after")
    def _key_and_peers_when_enabled(self) -> Self:
        issues = []
        if self.enabled and not (self.key_file or "").strip():
            issues.append(
                (
                    ".keyFile",
                    f"Required value: replicaSync.enabled {go_value(True)} needs a shared key "
                    "file: the syncer never runs unauthenticated",
                )
            )
        if self.enabled and not self.peers and self.peer_service is None:
            issues.append(
                (
                    ".peers",
                    f"Required value: replicaSync.enabled {go_value(True)} needs peers or "
                    "peerService: with neither, nothing would be sent or heard",
                )
            )
        if issues:
            raise rule_error(*issues)
        return self

    def service_address(self) -> tuple[str, int] | None:
        """`peerService` as (name, port), the section's port when it names none."""
        return None if self.peer_service is None else split_service(self.peer_service, self.port)


def split_service(value: str, port: int) -> tuple[str, int]:
    """`name` (at `port`) or `name:port` as (name, port); ValueError otherwise."""
    if ":" not in value:
        if not value:
            raise ValueError("peerService: expected a DNS name or name:port, not empty")
        return check_name(value), port
    host, named_port = split_hostport(value)
    return check_name(host), named_port


def parse_keys(data: bytes, path: str) -> list[bytes]:
    """The keys in a key file's `data` (`keyFile`: one a line, first signs); ValueError naming
    `path` and the line of the first problem."""
    keys: list[bytes] = []
    seen: dict[bytes, int] = {}
    for number, raw in enumerate(data.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith(b"#"):
            continue
        if control := _control_bytes(raw, line):
            listed = ", ".join(f"0x{b:02x}" for b in control)
            raise ValueError(
                f"{path} line {number} holds control bytes ({listed}): a key file holds one "
                "text or base64 key per line, not raw bytes (e.g. `head -c 32 /dev/urandom | "
                "base64`)"
            )
        if len(line) < MIN_KEY_BYTES:
            raise ValueError(
                f"{path} line {number} holds {len(line)} bytes; each key needs at least "
                f"{MIN_KEY_BYTES} (e.g. `head -c 32 /dev/urandom | base64`)"
            )
        if line in seen:
            raise ValueError(f"{path} line {number} repeats the key of line {seen[line]}")
        seen[line] = number
        keys.append(line)
    if not keys:
        raise ValueError(f"{path} holds no key (only blank lines or # comments)")
    if len(keys) > MAX_KEYS:
        raise ValueError(f"{path} holds {len(keys)} keys, at most {MAX_KEYS} (the first signs)")
    return keys


def _control_bytes(raw: bytes, line: bytes) -> list[int]:
    """The control bytes of a key file's line `raw` (`line`: stripped): a raw binary key's,
    which splitting at newline bytes and stripping would silently turn into another key. A
    tab is whitespace at the edges, not inside a key."""
    found = {b for b in raw if b < 0x20 or b == 0x7F} - {0x09}
    if 0x09 in line:
        found.add(0x09)
    return sorted(found)
