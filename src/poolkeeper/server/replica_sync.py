"""Cross-replica sync in a running EPP: `spec.replicaSync` made into a bound hub, a UDP
transport, peer discovery and metrics, started after the Director and stopped with it.

Why here: the composition root is the one place that holds both the built scheduler (the hub
binds to it, `scheduling/replicasync/fold.py`) and the section; the parts themselves know
nothing of each other beyond the hub's `take` / `deliver` (`scheduling/replicasync/`).

The origin is this replica's name (`origin`, else `$POD_NAME`, else the host name) plus a random
boot id: a restarted replica is a new origin, so its peers neither refuse its first batches as
replays nor keep counting the requests its old life sent (those expire with the hub's TTL).
The keys are read by the caller (`sync_keys.py`, which also follows the file while running and
swaps them into the codec) or, without them, from the key file at start (a ConfigError naming
the file and line: the syncer never runs unauthenticated). Every `reconcileIntervalMs` the
transport sends the hub's open statement, which is also the heartbeat
(`scheduling/replicasync/openset.py`). The runtime's side (started late with `keyOptional`,
metrics) is `sync_service.py`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from poolkeeper.datastore.snapshot import DatastoreSnapshot
from poolkeeper.datastore.store import ChangeKind
from poolkeeper.errors import ConfigError
from poolkeeper.scheduling.replicasync.codec import Codec
from poolkeeper.scheduling.replicasync.config import ReplicaSyncConfig
from poolkeeper.scheduling.replicasync.discovery import PeerDiscovery, own_addresses, parse_peers
from poolkeeper.scheduling.replicasync.events import Batch, Sent, SyncEvent
from poolkeeper.scheduling.replicasync.fold import SchedulerFold, bind_scheduler
from poolkeeper.scheduling.replicasync.hub import ReplicaSync, clears
from poolkeeper.scheduling.replicasync.peerunseen import PeerUnseen
from poolkeeper.scheduling.replicasync.transport import SyncTransport
from poolkeeper.scheduling.scheduler import Scheduler
from poolkeeper.server.sync_keys import read_keys

log = logging.getLogger("poolkeeper.replicasync")

EXPIRE_EVERY_S = 1.0  # silent peers are forgotten this often even when no batch arrives
_NAME_BYTES = 200  # of the origin's base name (the codec carries 255 bytes)


class _SignallingSync(ReplicaSync):
    """The hub, telling the transport what it has to send (`on_publish`)."""

    def __init__(self, origin: str) -> None:
        super().__init__(origin)
        self.on_publish: Callable[[SyncEvent], None] = lambda event: None

    def publish(self, event: SyncEvent) -> None:
        super().publish(event)
        self.on_publish(event)


class _Notified(Protocol):
    def notify(self, *, at_once: bool = False) -> None: ...


def notifier(transport: _Notified, at_once: bool) -> Callable[[SyncEvent], None]:
    """The hub's `on_publish`: a decision (`Sent`) flushed on the loop's next turn when
    `at_once` (`sendAtOnce`), everything else after the flush interval."""
    if not at_once:
        return lambda event: transport.notify()
    return lambda event: transport.notify(at_once=isinstance(event, Sent))


class SpreadWake:
    """`wake` once, `after_s` plus a random delay of up to `spread_s` after it is first asked
    for (both 0: at once; `after_s` is `claimGraceMs`: the room a peer's first byte opened is
    claimed until then, `scheduling/releaseclaims.py`). Why: a peer's first byte reaches
    every replica at the same moment; woken at once, each would release its held new prefixes
    onto the one server whose backlog just fell, none seeing the others' sends yet (a herd).
    Spread, each replica's placement reaches the others (a flush and a datagram away) before
    most of them decide."""

    def __init__(
        self,
        wake: Callable[[], None],
        spread_s: float,
        rng: random.Random | None = None,
        after_s: float = 0.0,
    ) -> None:
        self._wake, self.spread_s, self.after_s = wake, spread_s, after_s
        self._rng = rng or random.Random()
        self._armed: asyncio.TimerHandle | None = None
        self._claims_end = 0.0  # loop time the latest claim asked for ends (`after_s` > 0)

    def __call__(self) -> None:
        if self.spread_s <= 0 and self.after_s <= 0:
            self._wake()
            return
        loop = asyncio.get_running_loop()
        if self.after_s > 0:
            self._claims_end = max(self._claims_end, loop.time() + self.after_s)
        if self._armed is None:
            delay = self.after_s + self._rng.uniform(0, max(self.spread_s, 0.0))
            self._armed = loop.call_later(delay, self._fire)

    def _fire(self) -> None:
        self._armed = None
        self._wake()
        # A call merged into this wake claimed room until later: wake again when that claim
        # has ended, else a request held for it waits for the next scrape. Claims ending
        # within half a millisecond count as this wake's (calls of one moment coalesce).
        left = self._claims_end - asyncio.get_running_loop().time()
        if left > min(0.0005, self.after_s / 4):
            self._armed = asyncio.get_running_loop().call_later(left, self._fire)

    def cancel(self) -> None:
        if self._armed is not None:
            self._armed.cancel()
            self._armed = None


def origin_name(configured: str | None) -> str:
    """This process's unique name in the exchange (the module docstring)."""
    base = configured or os.environ.get("POD_NAME") or socket.gethostname() or "epp"
    return f"{base.encode()[:_NAME_BYTES].decode(errors='ignore')}-{secrets.token_hex(4)}"


@dataclass
class RunningSync:
    """The started syncer: stop it with `stop` (sends what is left, closes the socket)."""

    hub: ReplicaSync
    fold: SchedulerFold
    transport: SyncTransport
    discovery: PeerDiscovery
    wake: SpreadWake | None = None
    unseen: PeerUnseen | None = None  # the peers' sends since each scrape (`peerUnseen`)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def pool_changed(self, snapshot: DatastoreSnapshot, kind: ChangeKind) -> None:
        """A datastore listener: the fold and the peers' unseen sends accept peers' sends only
        to the pool's endpoints, and forget what they sent to the ones that left."""
        if kind is not ChangeKind.METRICS:
            keep = {e.hostport for e in snapshot.all_endpoints()}
            self.fold.forget_endpoints(keep)
            if self.unseen is not None:
                self.unseen.forget_endpoints(keep)

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


def bind(
    hub: ReplicaSync,
    scheduler: Scheduler,
    *,
    pool: set[str] | None = None,
    clock: Callable[[], float] | None = None,
    claim_s: float = 0.0,
) -> SchedulerFold:
    """`bind_scheduler`, a profile it cannot bind to (no prefill-backlog-scorer) a ConfigError."""
    try:
        return bind_scheduler(hub, scheduler, pool=pool, clock=clock, claim_s=claim_s)
    except ValueError as exc:
        raise ConfigError(f"spec.replicaSync: {exc}") from None


async def start_replica_sync(
    config: ReplicaSyncConfig,
    scheduler: Scheduler,
    *,
    clock: Callable[[], float] = time.monotonic,
    wake: Callable[[], None] | None = None,
    pool: set[str] | None = None,
    keys: list[bytes] | None = None,
) -> RunningSync:
    """Bind a hub to `scheduler`, bind the socket, follow the peers (ConfigError for a bad key
    or a profile without a prefill-backlog-scorer; OSError when the port is taken). `wake`:
    called after peer batches are folded in (flow control's pump: a peer's first byte may
    release a request held for its prefill backlog), spread by `peerWakeSpreadMs`. `pool`: the
    endpoints (ip:port) peers' sends may name, the datastore's at start (`pool_changed` keeps
    it current); None accepts any (tests). `clock`: the scheduler's clock, the one its
    decisions' `now` comes from (the Director's): peers' sends are stamped with it in the same
    backlogs as own ones, and the own open sends the statements list age on it. `keys`: the
    shared keys (`sync_keys.KeyFile`), read from `config.key_file` when None."""
    if keys is None:
        keys = read_keys(config.key_file, config.key_field)
    origin = origin_name(config.origin)
    hub = _SignallingSync(origin)
    claim_s = config.claim_grace_ms / 1000.0
    fold = bind(hub, scheduler, pool=pool, clock=clock, claim_s=claim_s)
    if config.peer_unseen and not config.send_at_once:
        log.warning(
            "replica sync: peerUnseen is on with sendAtOnce off: peers' decisions arrive "
            "about flushIntervalMs late, when counting them pays off only well under 1 ms "
            "(docs/notes/2026-12-07-replicas-sub-ms.md)"
        )
    unseen = PeerUnseen(pool=pool) if config.peer_unseen else None
    if unseen is not None:  # stamped on `clock`, the scrapes' clock (the runtime's)
        hub.bind(unseen)

    spread_s = config.peer_wake_spread_ms / 1000.0
    spread = SpreadWake(wake, spread_s, after_s=claim_s) if wake else None

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
        own = await own_addresses(config.address, port)
    except BaseException:  # the port taken, or cancelled (a runtime stopped while it starts)
        fold.unbind()
        transport.close()
        raise
    hub.on_publish = notifier(transport, config.send_at_once)
    discovery = PeerDiscovery(
        static=parse_peers(config.peers),
        service=config.service_address(),
        own=own,
        resolve_interval_s=config.resolve_interval_ms / 1000.0,
    )
    running = RunningSync(hub, fold, transport, discovery, spread, unseen)
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
