"""Cross-replica sync in a running EPP: `spec.replicaSync` made into a bound hub, a UDP
transport, peer discovery and metrics, started after the Director and stopped with it.

Why here: the composition root is the one place that holds both the built scheduler (the hub
binds to it, `scheduling/replicasync/fold.py`) and the section; the parts themselves know
nothing of each other beyond the hub's `take` / `deliver` (`scheduling/replicasync/`).

The origin is this replica's name (`origin`, else `$POD_NAME`, else the host name) plus a random
boot id: a restarted replica is a new origin, so its peers neither refuse its first batches as
replays nor keep counting the requests its old life sent (those expire with the hub's TTL).
The key file is read once at start (one key a line: the first signs, all verify, for rotation);
a missing or unreadable file, or a short, repeated or missing key, is a ConfigError naming the
file and line: the syncer never runs unauthenticated. With `keyOptional`, only an empty key
directory (an optional Secret volume without its Secret) leaves sync off (`key_missing`).
Every `reconcileIntervalMs` the transport sends the hub's open statement, which is also the
heartbeat (`scheduling/replicasync/openset.py`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import secrets
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from poolkeeper.datastore.store import ChangeKind, DatastoreSnapshot
from poolkeeper.errors import ConfigError
from poolkeeper.scheduling.replicasync.codec import Codec
from poolkeeper.scheduling.replicasync.config import ReplicaSyncConfig, parse_keys
from poolkeeper.scheduling.replicasync.discovery import PeerDiscovery, own_addresses, parse_peers
from poolkeeper.scheduling.replicasync.events import Batch, SyncEvent
from poolkeeper.scheduling.replicasync.fold import SchedulerFold, bind_scheduler
from poolkeeper.scheduling.replicasync.hub import ReplicaSync, clears
from poolkeeper.scheduling.replicasync.transport import SyncTransport
from poolkeeper.scheduling.scheduler import Scheduler
from poolkeeper.server.transport import by_reason, counters

log = logging.getLogger("poolkeeper.replicasync")

EXPIRE_EVERY_S = 1.0  # silent peers are forgotten this often even when no batch arrives
_NAME_BYTES = 200  # of the origin's base name (the codec carries 255 bytes)
KEY_FIELD = "spec.replicaSync.keyFile"  # what the key's errors name unless told otherwise


class _SignallingSync(ReplicaSync):
    """The hub, telling the transport when it has something to send (`on_publish`)."""

    def __init__(self, origin: str) -> None:
        super().__init__(origin)
        self.on_publish: Callable[[], None] = lambda: None

    def publish(self, event: SyncEvent) -> None:
        super().publish(event)
        self.on_publish()


class SpreadWake:
    """`wake` once, a random delay of up to `spread_s` after it is first asked for (0: at
    once). Why: a peer's first byte reaches every replica at the same moment; woken at once,
    each would release its held new prefixes onto the one server whose backlog just fell, none
    seeing the others' sends yet (a herd). Spread, each replica's placement reaches the others
    (a flush and a datagram away) before most of them decide."""

    def __init__(
        self, wake: Callable[[], None], spread_s: float, rng: random.Random | None = None
    ) -> None:
        self._wake, self.spread_s = wake, spread_s
        self._rng = rng or random.Random()
        self._armed: asyncio.TimerHandle | None = None

    def __call__(self) -> None:
        if self.spread_s <= 0:
            self._wake()
        elif self._armed is None:
            loop = asyncio.get_running_loop()
            self._armed = loop.call_later(self._rng.uniform(0, self.spread_s), self._fire)

    def _fire(self) -> None:
        self._armed = None
        self._wake()

    def cancel(self) -> None:
        if self._armed is not None:
            self._armed.cancel()
            self._armed = None


def origin_name(configured: str | None) -> str:
    """This process's unique name in the exchange (the module docstring)."""
    base = configured or os.environ.get("POD_NAME") or socket.gethostname() or "epp"
    return f"{base.encode()[:_NAME_BYTES].decode(errors='ignore')}-{secrets.token_hex(4)}"


def key_missing(config: ReplicaSyncConfig, field: str = KEY_FIELD) -> str | None:
    """Why sync stays off (`keyOptional` and the key's optional Secret not created yet), or
    None: start it. Optional only when the key file's directory exists and holds no files:
    what an optional Secret volume mounts without its Secret (an empty directory, or only the
    kubelet's `..data` link and `..<timestamp>` directory). Anything else (the directory
    missing: a wrong mountPath; other files there: the Secret's data key is not the file's
    name; the path unreadable) is a ConfigError naming the field: a typo must not leave sync
    off for good behind one warning."""
    path = config.key_file
    if not config.key_optional or not path:
        return None
    key = Path(path)
    try:
        key.stat()
        return None  # there: read_keys reads (and checks) it
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise ConfigError(f"{field}: cannot check {path}: {exc.strerror}") from None
    folder = key.parent
    try:
        present = sorted(e.name for e in folder.iterdir() if not e.name.startswith(".."))
    except FileNotFoundError:
        raise ConfigError(
            f"{field}: {path} does not exist, nor does its directory {folder}: keyOptional "
            "covers only an optional Secret volume mounted there without its Secret (check "
            "the volume's mountPath)"
        ) from None
    except OSError as exc:
        raise ConfigError(f"{field}: cannot list {folder}: {exc.strerror}") from None
    if present:
        raise ConfigError(
            f"{field}: {path} does not exist, but {folder} holds {', '.join(present[:8])}: "
            "keyFile must name the key's file (the Secret's data key)"
        )
    return (
        f"replica sync stays off: {field} {path} does not exist and its directory is empty "
        "(keyOptional: the optional Secret is not created). Create the shared key (e.g. the "
        "Secret the deployment mounts there: kubectl create secret generic <pool>-epp-sync "
        '--from-literal=key="$(head -c 32 /dev/urandom | base64)") and restart the replicas'
    )


def read_keys(path: str | None, field: str = KEY_FIELD) -> list[bytes]:
    """The shared keys in `path` (`config.parse_keys`: the first signs); ConfigError naming
    `field`, the file and the line otherwise."""
    if not path:
        raise ConfigError(f"{field}: required: the syncer never runs without a key")
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{field}: cannot read {path}: {exc.strerror}") from None
    try:
        return parse_keys(data, path)
    except ValueError as exc:
        raise ConfigError(f"{field}: {exc}") from None


def check_key(config: ReplicaSyncConfig, field: str = KEY_FIELD) -> str | None:
    """What the start will find of the key, checked before anything starts: why sync stays
    off (`key_missing`), None when the key reads, ConfigError naming `field` otherwise. For
    the EPP command, whose key file is a plugin parameter (cli/epp.py)."""
    if not config.enabled:
        return None
    if (why := key_missing(config, field)) is not None:
        return why
    read_keys(config.key_file, field)
    return None


@dataclass
class RunningSync:
    """The started syncer: stop it with `stop` (sends what is left, closes the socket)."""

    hub: ReplicaSync
    fold: SchedulerFold
    transport: SyncTransport
    discovery: PeerDiscovery
    wake: SpreadWake | None = None
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def pool_changed(self, snapshot: DatastoreSnapshot, kind: ChangeKind) -> None:
        """A datastore listener: the fold accepts peers' sends only to the pool's endpoints,
        and forgets what they sent to the ones that left."""
        if kind is not ChangeKind.METRICS:
            self.fold.forget_endpoints({e.hostport for e in snapshot.all_endpoints()})

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.transport.close()
        self.fold.unbind()
        if self.wake is not None:
            self.wake.cancel()


async def _heartbeat(transport: SyncTransport, interval_s: float) -> None:
    """The open statement every `interval_s` (`reconcileIntervalMs`, at most a third of the
    peers' TTL): the peers drop what it no longer lists (a lost first byte or end), and a
    replica whose requests are all long and in flight, telling nothing new for a while, is
    not expired (its peers would drop its entries while they still load the servers)."""
    while True:
        await asyncio.sleep(interval_s)
        transport.flush(heartbeat=True)


async def _expire(hub: ReplicaSync, clock: Callable[[], float]) -> None:
    while True:
        await asyncio.sleep(EXPIRE_EVERY_S)
        for origin in hub.expire(clock()):
            log.info("replica sync: %s went silent; its requests no longer count", origin)


async def start_replica_sync(
    config: ReplicaSyncConfig,
    scheduler: Scheduler,
    *,
    clock: Callable[[], float] = time.monotonic,
    wake: Callable[[], None] | None = None,
    pool: set[str] | None = None,
) -> RunningSync:
    """Bind a hub to `scheduler`, bind the socket, follow the peers (ConfigError for a bad key
    or a profile without a prefill-backlog-scorer; OSError when the port is taken). `wake`:
    called after peer batches are folded in (flow control's pump: a peer's first byte may
    release a request held for its prefill backlog), spread by `peerWakeSpreadMs`. `pool`: the
    endpoints (ip:port) peers' sends may name, the datastore's at start (`pool_changed` keeps
    it current); None accepts any (tests). `clock`: the scheduler's clock, the one its
    decisions' `now` comes from (the Director's): peers' sends are stamped with it in the same
    backlogs as own ones, and the own open sends the statements list age on it."""
    keys = read_keys(config.key_file)
    origin = origin_name(config.origin)
    hub = _SignallingSync(origin)
    try:
        fold = bind_scheduler(hub, scheduler, pool=pool, clock=clock)
    except ValueError as exc:
        raise ConfigError(f"spec.replicaSync: {exc}") from None

    spread = SpreadWake(wake, config.peer_wake_spread_ms / 1000.0) if wake else None

    def deliver(batch: Batch, now: float) -> bool:
        taken = hub.deliver(batch, now)
        # Only a peer's first byte or end shrinks the backlog the hold reads; its sends
        # alone can release nothing, so they do not run the pump.
        if taken and spread is not None and clears(batch):
            try:
                spread()
            except Exception:  # the batch is folded in: a failed wake must not count it as lost
                log.exception("replica sync: waking flow control after a peer's batch")
        return taken

    transport = SyncTransport(
        Codec(keys, max_bytes=config.max_datagram_bytes),
        origin,
        hub.take,
        deliver,
        clock=clock,
        flush_interval_s=config.flush_interval_ms / 1000.0,
        max_age_s=config.max_age_ms / 1000.0,
        state=hub.statement,
    )
    try:
        host, port = await transport.start(config.address, config.port)
    except OSError:
        fold.unbind()
        raise
    hub.on_publish = transport.notify
    discovery = PeerDiscovery(
        static=parse_peers(config.peers),
        service=config.service_address(),
        own=await own_addresses(config.address, port),
        resolve_interval_s=config.resolve_interval_ms / 1000.0,
    )
    running = RunningSync(hub, fold, transport, discovery, spread)
    running._tasks = [
        asyncio.create_task(discovery.follow(transport.set_peers), name="replica-sync-peers"),
        asyncio.create_task(_expire(hub, clock), name="replica-sync-expire"),
        asyncio.create_task(
            _heartbeat(transport, min(config.reconcile_interval_ms / 1000.0, hub.peer_ttl_s / 3.0)),
            name="replica-sync-heartbeat",
        ),
    ]
    for task in running._tasks:
        task.add_done_callback(_log_death)
    log.info(
        "replica sync on udp %s:%d as %s (receive buffer %d bytes)",
        host, port, origin, transport.receive_buffer,
    )  # fmt: skip
    return running


def _log_death(task: asyncio.Task[None]) -> None:
    """A background task of the syncer that ended with an exception says so (else the peers
    would silently stop being followed, or silent peers stop expiring)."""
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("replica sync: %s stopped", task.get_name(), exc_info=exc)


class SyncCollector(Collector):
    """`poolkeeper_replica_sync_*` at scrape time (docs/kubernetes.md lists them); with
    `running` None (turned on, but its optional key is not there) only `_enabled` 0."""

    def __init__(self, running: RunningSync | None) -> None:
        self.running = running

    def collect(self) -> Iterator[Metric]:
        prefix = "poolkeeper_replica_sync"
        yield GaugeMetricFamily(
            f"{prefix}_enabled",
            "1 while the syncer runs; 0 when it is turned on but stays off (keyOptional, "
            "no key yet).",
            value=0 if self.running is None else 1,
        )
        if self.running is None:
            return
        stats, hub = self.running.transport.stats, self.running.hub
        yield from counters(
            prefix,
            ("batches_sent", stats.batches_sent, "Own batches sent to the peers."),
            ("datagrams_sent", stats.datagrams_sent, "Datagrams sent, every peer counted."),
            ("batches_received", stats.received, "Peers' batches verified and folded in."),
            ("batches_refused", stats.refused, "Verified batches the hub refused."),
            ("outbox_dropped", hub.dropped, "Own events dropped from a full outbox."),
            (
                "reconciled",
                hub.reconciled,
                "Peers' sends dropped because their open statement no longer listed them "
                "(their first byte or end was lost in transit).",
            ),
            (
                "verified_old_key",
                self.running.transport.codec.verified_old,
                "Datagrams verified by a key other than the first (rotation: 0 once every "
                "replica signs with the new key).",
            ),
            (
                "blocks_trimmed",
                self.running.transport.codec.trimmed,
                "Own sends whose prefix blocks did not all fit a datagram (tail not sent).",
            ),
        )
        yield by_reason(f"{prefix}_rejected", "Datagrams rejected, by reason.", stats.rejected)
        yield by_reason(f"{prefix}_send_dropped", "Datagrams not sent, by reason.", stats.dropped)
        peers = len(self.running.transport.peers)
        yield GaugeMetricFamily(f"{prefix}_peers", "Peer addresses sent to.", value=peers)
        yield GaugeMetricFamily(
            f"{prefix}_origins", "Peers heard from within the TTL.", value=len(hub.peers())
        )
